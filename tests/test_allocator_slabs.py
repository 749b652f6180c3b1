"""Tests of the slab bookkeeping: which allocations share slabs, how slabs grow, how spare granules are taken."""

from __future__ import annotations

from torpor.allocator.mapping import MappedRange
from torpor.allocator.slabs import Slabs

G = 2 << 20
KEY = (0, "weights")


def test_only_one_granule_allocations_go_into_slabs() -> None:
    """A slab takes allocations of exactly one granule, and none when the limit is a granule or less."""
    assert Slabs(64 * G).enabled(G, G)
    assert not Slabs(64 * G).enabled(2 * G, G)
    assert not Slabs(G).enabled(G, G) and not Slabs(0).enabled(G, G)


def test_slabs_double_from_two_granules_up_to_the_limit() -> None:
    """Successive slabs of a key are 2, 4, 8, ... granules, never over the limit, per key."""
    slabs = Slabs(16 * G)
    sizes = []
    for i in range(6):
        size = slabs.next_size(KEY, G)
        sizes.append(size // G)
        slabs.add(KEY, MappedRange(i * 64 * G, size, object(), 0), G)
    assert sizes == [2, 4, 8, 16, 16, 16]
    assert slabs.next_size((1, "weights"), G) == 2 * G


def test_take_carves_spare_granules_in_address_order_and_counts_users() -> None:
    """take() hands out a live slab's spare granules one by one, raising its user count, then None when full."""
    slabs = Slabs(8 * G)
    m = MappedRange(0, 4 * G, object(), 0)
    slabs.add(KEY, m, G)
    assert slabs.spare_bytes(KEY) == 3 * G
    got = [slabs.take(KEY, G) for _ in range(3)]
    assert [g[0] for g in got if g] == [G, 2 * G, 3 * G] and m.users == 4
    assert slabs.take(KEY, G) is None and slabs.spare_bytes() == 0


def test_unmapped_or_forgotten_slabs_give_nothing() -> None:
    """A slab whose handle is gone, or that was forgotten or closed with its tag, is never taken from."""
    slabs = Slabs(8 * G)
    m = MappedRange(0, 4 * G, object(), 0)
    slabs.add(KEY, m, G)
    m.handle = None
    assert slabs.take(KEY, G) is None and slabs.count() == 0
    m2 = MappedRange(8 * G, 4 * G, object(), 0)
    slabs.add(KEY, m2, G)
    slabs.forget(KEY, m2)
    assert slabs.take(KEY, G) is None
    slabs.add(KEY, MappedRange(16 * G, 4 * G, object(), 0), G)
    slabs.close(KEY)
    assert slabs.take(KEY, G) is None and slabs.count(KEY) == 0
