"""Tests of the mapping planners: taking backup extents off the front of a pinned-extent queue, clipping pieces to spans."""

from __future__ import annotations

import itertools
import random
from collections import deque
from typing import Any

from support import RigMaker

from torpor.allocator.host.offload import Extent
from torpor.allocator.sleepwake.plan import Piece, clip, clip_each, take_front


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


class _Counted(Piece):
    """A piece that counts how often a planner reads it (a field, a subscript or unpacking)."""

    __slots__ = ()
    reads = 0

    def __getattribute__(self, name: str) -> Any:
        if name in Piece._fields:
            _Counted.reads += 1
        return super().__getattribute__(name)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        _Counted.reads += 1
        return tuple.__getitem__(self, i)

    def __iter__(self):  # type: ignore[no-untyped-def]
        _Counted.reads += 1
        return tuple.__iter__(self)


def _random_case(seed: int) -> tuple[list[Piece], list[tuple[int, int]]]:
    rng = random.Random(seed)
    parts: list[Piece] = []
    pos = 0
    for _ in range(500):
        pos += rng.choice([0, 0, 7, 64])
        n = rng.choice([1, 5, 64, 300])
        parts.append(Piece(pos, pos, n, 0))
        pos += n
    ranges, lo = [], 0
    while lo < pos + 50:
        lo += rng.choice([0, 3, 40])
        hi = lo + rng.choice([1, 17, 128, 1000])
        ranges.append((lo, hi))
        lo = hi
    return parts, ranges


def test_clip_each_equals_clip_per_range() -> None:
    """clip_each gives exactly what clip gives range by range (pieces crossing range ends, gaps, unsorted input)."""
    for seed in range(20):
        parts, ranges = _random_case(seed)
        expected = [clip(parts, lo, hi) for lo, hi in ranges]
        assert clip_each(parts, ranges) == expected
        shuffled = parts[:]
        random.Random(seed).shuffle(shuffled)
        assert clip_each(shuffled, ranges) == expected


def test_wake_reads_each_backed_up_piece_a_bounded_number_of_times(make_rig: RigMaker) -> None:
    """A wake of 2048 one-granule allocations in 128 spans reads the backup's pieces O(pieces + spans) times, not per span."""
    g = 64 << 10
    alloc = make_rig(capacity=256 << 20, granularity=g, group_bytes=16 * g).allocator
    addresses = [alloc.allocate(g, "weights") for _ in range(2048)]
    for i, a in enumerate(addresses[::97]):
        alloc.write(a, bytes([i % 251]) * 64)
    alloc.backup(["weights"])
    alloc.release(["weights"])
    record = alloc.tag_state("weights")
    record.pieces = [_Counted(*p) for p in record.pieces]
    _Counted.reads = 0
    alloc.restore(["weights"])
    assert _Counted.reads <= 16 * len(record.pieces), f"{_Counted.reads} reads of {len(record.pieces)} pieces"
    assert all(alloc.read(a, 64) == bytes([i % 251]) * 64 for i, a in enumerate(addresses[::97]))
    alloc.close()
