"""Tests of the per-tag virtual address arena."""

from __future__ import annotations

from torpor.allocator import SimDriver
from torpor.allocator.va import VaArena

G = 64 * 1024


def test_allocations_are_adjacent_and_reused() -> None:
    """Consecutive takes are adjacent; a freed range is reused first-fit and merged with neighbours."""
    sim = SimDriver(granularity=G)
    arena = VaArena(sim, 0, block=16 * G)
    a, b, c = arena.take(G), arena.take(2 * G), arena.take(G)
    assert b == a + G and c == b + 2 * G
    arena.give(a, G)
    arena.give(b, 2 * G)
    assert arena.take(3 * G) == a
    assert sim.count("reserve") == 1


def test_oversized_take_gets_its_own_reservation_and_close_frees_all() -> None:
    """A take larger than the block reserves exactly enough; close unreserves everything."""
    sim = SimDriver(granularity=G)
    arena = VaArena(sim, 0, block=4 * G)
    arena.take(G)
    arena.take(8 * G)
    assert sim.count("reserve") == 2
    arena.close()
    assert sim.count("unreserve") == 2
