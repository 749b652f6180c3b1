"""Tests of the pinned host arena: pinning ahead in the background, taking, giving, trimming."""

from __future__ import annotations

import pytest

from torpor.allocator import AllocatorOutOfMemory, HostArena, HostPolicy, SimDriver

C = 64 * 1024


def test_want_pins_ahead_in_the_background() -> None:
    """want() returns at once and the pinner reaches the target in chunks."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, threads=2))
    arena.want(5 * C)
    assert arena.wait_ready(10)
    assert arena.pinned_bytes() == 5 * C
    assert sim.host_used == 5 * C
    arena.close()
    assert sim.host_used == 0


def test_no_prepin_policy_pins_only_on_take() -> None:
    """With prepin off, want() does nothing and take() pins what it needs."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C))
    arena.want(4 * C)
    assert arena.pinned_bytes() == 0
    extents = arena.take(3 * C + 1)
    assert sum(e.nbytes for e in extents) == 3 * C + 1
    assert arena.pinned_bytes() == 4 * C


def test_extents_stay_inside_chunks_and_come_back() -> None:
    """Extents never cross a chunk; given back, the space is reused without pinning more."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C))
    extents = arena.take(5 * C // 2)
    for e in extents:
        chunk = next(k for k in arena._chunks if k == e.chunk)
        assert chunk <= e.host and e.host + e.nbytes <= chunk + C
    arena.give(extents)
    assert arena.used_bytes() == 0
    arena.take(3 * C)
    assert sim.count("host_alloc") == 3


def test_keep_after_wake_off_unpins_empty_chunks() -> None:
    """With keep_after_wake off, giving back the last extent of a chunk unpins it."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, keep_after_wake=False, chunk_bytes=C))
    arena.give(arena.take(2 * C))
    assert arena.pinned_bytes() == 0
    assert sim.host_used == 0


def test_trim_returns_unused_chunks_only() -> None:
    """trim() unpins chunks holding no backup and keeps the others."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C))
    held = arena.take(C)
    arena.give(arena.take(2 * C))
    assert arena.trim() == 2 * C
    assert arena.used_bytes() == C
    arena.give(held)


def test_pin_failure_is_out_of_memory_and_keeps_what_was_pinned() -> None:
    """A pin that runs out of host memory raises AllocatorOutOfMemory; earlier chunks stay usable."""
    sim = SimDriver(granularity=C, host_capacity=2 * C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C, threads=1))
    with pytest.raises(AllocatorOutOfMemory):
        arena.take(3 * C)
    assert arena.pinned_bytes() == 2 * C


def test_background_pin_failure_is_recorded_not_raised() -> None:
    """A failing background pin is kept as last_error and wait_ready returns."""
    sim = SimDriver(granularity=C)
    sim.fail("host_alloc", times=100)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, threads=1))
    arena.want(C)
    assert arena.wait_ready(10)
    assert arena.last_error is not None
    arena.close()


def test_pause_holds_the_pinner() -> None:
    """While paused (a capture in progress) nothing is pinned; resume lets it finish."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, threads=1))
    arena.pause()
    arena.want(2 * C)
    assert not arena.wait_ready(0.2)
    arena.resume()
    assert arena.wait_ready(10)
    arena.close()


def test_pinned_bytes_track_the_driver_through_pins_takes_trims_and_close() -> None:
    """pinned_bytes() equals the host memory the driver holds after background pins, takes, trims and close."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, threads=3, keep_after_wake=True))
    arena.want(40 * C)
    assert arena.wait_ready(10)
    assert arena.pinned_bytes() == sim.host_used == 40 * C
    held = arena.take(45 * C)  # pins five more now
    assert arena.pinned_bytes() == sim.host_used == 45 * C
    arena.give(held[: len(held) // 2])
    arena.trim()
    assert arena.pinned_bytes() == sim.host_used < 45 * C
    arena.close()
    assert arena.pinned_bytes() == sim.host_used == 0
