"""Tests of the mapping planners: taking backup extents off the front of a pinned-extent queue."""

from __future__ import annotations

import itertools
from collections import deque

from torpor.allocator.mapping import take_front
from torpor.allocator.offload import Extent


def test_take_front_cuts_an_extent_and_leaves_the_rest_in_order() -> None:
    """Taking 5 off extents of 3 and 4 gives 3 and 2 of the second; 2 remain at the right host address."""
    rest = deque([Extent(100, 3, 0), Extent(200, 4, 1)])
    assert take_front(rest, 5) == [Extent(100, 3, 0), Extent(200, 2, 1)]
    assert list(rest) == [Extent(202, 2, 1)]


def test_take_front_splits_a_long_queue_into_consecutive_backups() -> None:
    """Consecutive takes partition the extents exactly: same total bytes, no overlap, no reordering."""
    rest = deque(Extent(i * 1000, 32, i) for i in range(64))
    taken = [take_front(rest, n) for n in [48] * 42 + [32]]
    flat = [e for part in taken for e in part]
    assert sum(e.nbytes for e in flat) == 64 * 32 and not rest
    assert [sum(e.nbytes for e in part) for part in taken] == [48] * 42 + [32]
    assert all(a.host + a.nbytes <= b.host or a.chunk != b.chunk for a, b in itertools.pairwise(flat))


def test_take_front_of_more_than_there_is_returns_what_there_is() -> None:
    """Asking beyond the queue returns every extent left (the caller sized the queue; nothing is invented)."""
    rest = deque([Extent(0, 8, 0)])
    assert take_front(rest, 100) == [Extent(0, 8, 0)] and not rest
