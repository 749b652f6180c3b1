"""Tests of the pinned host arena: pinning as a sleep copies or ahead in the background, taking, giving, trimming, limits."""

from __future__ import annotations

import threading

import pytest

from torpor.allocator import AllocatorError, AllocatorOutOfMemory, HostArena, HostPolicy, SimDriver
from torpor.allocator.host.offload import Extent

C = 64 * 1024


def pinned(arena: HostArena, extents: list[Extent]) -> list[Extent]:
    """Wait until every extent's chunk is pinned (what a backup does before each copy)."""
    for e in extents:
        arena.wait_pinned(e.host)
    return extents


class GatedSim(SimDriver):
    """A SimDriver whose pins wait for a gate, so a test can see chunks become ready one by one."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.gates: dict[int, threading.Event] = {}
        self.started: list[int] = []
        self._gate_lock = threading.Lock()

    def gate(self, host: int) -> threading.Event:
        with self._gate_lock:
            return self.gates.setdefault(host, threading.Event())

    def host_alloc(self, nbytes: int, host: int | None = None) -> int:
        if host is not None:
            with self._gate_lock:
                self.started.append(host)
            self.gate(host).wait(10)
        return super().host_alloc(nbytes, host)


def test_want_pins_ahead_in_the_background() -> None:
    """want() returns at once and the pinner reaches the target in chunks."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=True, chunk_bytes=C, threads=2))
    arena.want(5 * C)
    assert arena.wait_ready(10)
    assert arena.pinned_bytes() == 5 * C
    assert sim.host_used == 5 * C
    arena.close()
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_pinning_ahead_is_off_by_default() -> None:
    """The default policy pins nothing ahead: want() does nothing until a take."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C))
    arena.want(4 * C)
    assert arena.wait_ready(1)
    assert arena.pinned_bytes() == 0 and sim.count("host_alloc") == 0


def test_take_pins_what_it_needs_as_one_reservation() -> None:
    """take() reserves the missing bytes in one range and pins it chunk by chunk."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C))
    extents = pinned(arena, arena.take(3 * C + 1))
    assert sum(e.nbytes for e in extents) == 3 * C + 1
    assert arena.pinned_bytes() == 4 * C == sim.host_used
    assert sim.count("host_reserve") == 1 and sim.count("host_alloc") == 4
    arena.close()
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_take_returns_before_pinning_and_chunks_become_ready_in_order() -> None:
    """take() does not wait for pinning; the first chunk can be copied into while later ones still pin."""
    sim = GatedSim(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, threads=2))
    extents = arena.take(4 * C)
    bases = sorted({e.chunk for e in extents})
    assert arena.pinned_bytes() == 0
    sim.gate(bases[0]).set()
    arena.wait_pinned(bases[0])
    assert arena.pinned_bytes() == C  # the others are held at their gates
    for b in bases[1:]:
        sim.gate(b).set()
    pinned(arena, extents)
    assert arena.pinned_bytes() == 4 * C
    # pinned in address order: the two threads start on the two lowest chunks, in either order between them
    assert sorted(sim.started[:2]) == bases[:2]
    arena.close()


def test_extents_stay_inside_chunks_and_come_back() -> None:
    """Extents never cross a chunk; given back, the space is reused without pinning more."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C))
    extents = pinned(arena, arena.take(5 * C // 2))
    for e in extents:
        assert e.chunk <= e.host and e.host + e.nbytes <= e.chunk + C
    arena.give(extents)
    assert arena.used_bytes() == 0
    pinned(arena, arena.take(3 * C))
    assert sim.count("host_alloc") == 3


def test_keep_after_wake_off_unpins_empty_chunks() -> None:
    """With keep_after_wake off, giving back the last extent of a chunk unpins it."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, keep_after_wake=False, chunk_bytes=C))
    arena.give(pinned(arena, arena.take(2 * C)))
    assert arena.pinned_bytes() == 0
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_trim_returns_unused_chunks_only() -> None:
    """trim() unpins chunks holding no backup and keeps the others."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C))
    held = pinned(arena, arena.take(C))
    arena.give(pinned(arena, arena.take(2 * C)))
    assert arena.trim() == 2 * C
    assert arena.used_bytes() == C and sim.host_used == C
    arena.give(held)


def test_trim_in_the_background_gives_every_unused_chunk_back() -> None:
    """A background trim takes unused chunks off pinned_bytes() at once and unpins them all in its thread."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C))
    arena.give(pinned(arena, arena.take(8 * C)))
    assert arena.trim(background=True) == 8 * C
    assert arena.pinned_bytes() == 0
    assert arena.wait_unpinned(10)
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_pin_failure_is_out_of_memory_at_the_copy_and_keeps_what_was_pinned() -> None:
    """A chunk that runs out of host memory raises AllocatorOutOfMemory to the copy waiting for it; others stay usable."""
    sim = SimDriver(granularity=C, host_capacity=2 * C)
    arena = HostArena(sim, HostPolicy(prepin=False, chunk_bytes=C, threads=1))
    extents = arena.take(3 * C)
    with pytest.raises(AllocatorOutOfMemory):
        pinned(arena, extents)
    assert arena.pinned_bytes() == 2 * C
    arena.give(extents)
    arena.close()
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_limit_refuses_a_take_before_reserving_anything() -> None:
    """Over limit_bytes, take() raises AllocatorOutOfMemory naming the limit, and reserves or pins nothing."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, limit_bytes=2 * C))
    with pytest.raises(AllocatorOutOfMemory, match="limit is 131072"):
        arena.take(3 * C)
    assert sim.count("host_reserve") == 0 and arena.pinned_bytes() == 0
    pinned(arena, arena.take(2 * C))
    assert arena.pinned_bytes() == 2 * C


def test_pinning_ahead_stops_at_the_limit() -> None:
    """want() beyond limit_bytes pins up to the limit only."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=True, chunk_bytes=C, limit_bytes=3 * C))
    arena.want(10 * C)
    assert arena.wait_ready(10)
    assert arena.pinned_bytes() == 3 * C
    arena.close()


def test_configure_changes_the_policy_in_place() -> None:
    """configure() replaces policy fields; turning prepin off drops the pinning target."""
    arena = HostArena(SimDriver(granularity=C), HostPolicy(prepin=True, chunk_bytes=C))
    policy = arena.configure(prepin=False, limit_bytes=4 * C, keep_after_wake=False)
    assert (policy.prepin, policy.limit_bytes, policy.keep_after_wake) == (False, 4 * C, False)
    assert arena.policy is policy


def test_close_while_pinning_leaks_nothing() -> None:
    """Closing the arena while chunks are pinning waits for them and gives every byte back."""
    sim = GatedSim(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, threads=2))
    extents = arena.take(6 * C)
    first = sorted({e.chunk for e in extents})[0]
    sim.gate(first).set()
    arena.wait_pinned(first)
    closer = threading.Thread(target=arena.close)
    closer.start()
    for b in sorted({e.chunk for e in extents}):
        sim.gate(b).set()
    closer.join(10)
    assert not closer.is_alive()
    for _ in range(1000):  # workers finishing after close give their chunks back
        if sim.host_used == 0 and sim.host_reserved == 0:
            break
        threading.Event().wait(0.01)
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_wait_pinned_outside_every_chunk_is_an_error() -> None:
    """Waiting for an address the arena never handed out raises AllocatorError."""
    arena = HostArena(SimDriver(granularity=C), HostPolicy(chunk_bytes=C))
    with pytest.raises(AllocatorError, match="no chunk"):
        arena.wait_pinned(0x1234)


def test_background_pin_failure_is_recorded_not_raised() -> None:
    """A failing background pin is kept as last_error and wait_ready returns."""
    sim = SimDriver(granularity=C)
    sim.fail("host_alloc", times=100)
    arena = HostArena(sim, HostPolicy(prepin=True, chunk_bytes=C, threads=1))
    arena.want(C)
    assert arena.wait_ready(10)
    assert arena.last_error is not None
    arena.close()
    assert sim.host_reserved == 0


def test_pause_holds_the_pinner() -> None:
    """While paused (a capture in progress) nothing is pinned; resume lets it finish."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=True, chunk_bytes=C, threads=1))
    arena.pause()
    arena.want(2 * C)
    assert not arena.wait_ready(0.2)
    arena.resume()
    assert arena.wait_ready(10)
    arena.close()


def test_pinned_bytes_track_the_driver_through_pins_takes_trims_and_close() -> None:
    """pinned_bytes() equals the host memory the driver holds after background pins, takes, trims and close."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(prepin=True, chunk_bytes=C, threads=3, keep_after_wake=True))
    arena.want(40 * C)
    assert arena.wait_ready(10)
    assert arena.pinned_bytes() == sim.host_used == 40 * C
    held = pinned(arena, arena.take(45 * C))  # pins five more now
    assert arena.pinned_bytes() == sim.host_used == 45 * C
    arena.give(held[: len(held) // 2])
    arena.trim()
    assert arena.pinned_bytes() == sim.host_used < 45 * C
    arena.close()
    assert arena.pinned_bytes() == sim.host_used == 0


def test_a_failed_chunk_keeps_its_address_until_its_extents_come_back() -> None:
    """A chunk whose pin failed holds its range while extents of it are out: no later take gets the address, its copy sees the failure."""
    sim = SimDriver(granularity=C, reuse_host=True)  # mmap reuses a range given back
    sim.fail("host_alloc")
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, threads=1))
    first = arena.take(C)
    assert arena.wait_ready(10)  # its pin failed: nothing is pending
    second = pinned(arena, arena.take(C))  # another backup, taken before the first one copies
    assert not {e.host for e in first} & {e.host for e in second}, "two backups were given the same host memory"
    with pytest.raises(AllocatorError, match="injected failure"):
        arena.wait_pinned(first[0].host)
    arena.give(first)
    assert arena.used_bytes() == C and sim.host_reserved == C  # the failed range went back; the second is intact
    third = pinned(arena, arena.take(C))  # the address may now be reused
    assert third[0].host == first[0].host and arena.used_bytes() == 2 * C
    arena.give(second + third)
    arena.close()
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_a_take_gets_every_byte_when_a_chunk_it_counted_fails_meanwhile() -> None:
    """A chunk pinned ahead that a take counts, then fails while the take reserves more: the take is whole, the copy refused."""

    class FailsDuringReserve(GatedSim):
        arena: HostArena
        ahead = 0

        def host_reserve(self, nbytes: int) -> int:
            if self.ahead:  # the take's reservation: the chunk pinned ahead fails meanwhile
                self.gate(self.ahead).set()
                self.arena.wait_ready(10)
            self.ahead = super().host_reserve(nbytes)
            return self.ahead

    sim = FailsDuringReserve(granularity=C)
    sim.arena = arena = HostArena(sim, HostPolicy(prepin=True, chunk_bytes=C, threads=1))
    sim.fail("host_alloc")
    arena.want(C)  # one chunk reserved ahead, its pin held at the gate
    for _ in range(1000):
        if sim.started:
            break
        threading.Event().wait(0.01)
    extents = arena.take(2 * C)
    assert sum(e.nbytes for e in extents) == 2 * C, "a backup got fewer host bytes than it copies"
    for e in extents:
        sim.gate(e.chunk).set()
    with pytest.raises(AllocatorError, match="injected failure"):  # the copy into the failed chunk is refused
        pinned(arena, extents)
    # the fresh chunk's pin is queued on the take's own pool; close() waits only for pins already
    # running, so wait for it here (as a backup's later copies do) before checking that nothing leaked
    fresh = [e for e in extents if e.chunk == sim.ahead]
    assert fresh, "the take reserved a fresh chunk beside the failed one"
    pinned(arena, fresh)
    arena.give(extents)
    arena.close()
    assert sim.host_used == 0 and sim.host_reserved == 0


def test_close_gives_back_pins_still_queued_on_a_take_before_it_returns() -> None:
    """close() while most of a take's pins are still queued (one thread, held at a gate): when close returns, nothing is pinned or reserved."""

    class Held(GatedSim):
        """Pinning threads that give a range back wait until the test has looked (close must not leave them work)."""

        looked = threading.Event()

        def host_unreserve(self, host: int, nbytes: int) -> None:
            if threading.current_thread().name.startswith("torpor-host-pin"):
                self.looked.wait(5)
            super().host_unreserve(host, nbytes)

    sim = Held(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C, threads=1))
    extents = arena.take(8 * C)
    chunks = sorted({e.chunk for e in extents})
    for _ in range(1000):  # the one pinning thread is inside the first chunk's pin, the other seven wait in its queue
        if sim.started:
            break
        threading.Event().wait(0.01)
    closer = threading.Thread(target=arena.close)
    closer.start()
    sim.gate(chunks[0]).set()  # the running pin finishes; the queued ones must not be left for later
    closer.join(10)
    assert not closer.is_alive()
    left = (sim.host_used, sim.host_reserved)
    Held.looked.set()
    assert left == (0, 0), "pins queued before close were still holding host memory when close returned"
    assert sim.started == chunks[:1], "pins queued before close ran after it"


def test_take_after_close_is_refused() -> None:
    """A take on a closed arena raises AllocatorError saying it is closed, and reserves nothing."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=C))
    arena.close()
    with pytest.raises(AllocatorError, match="closed"):
        arena.take(2 * C)
    assert (sim.host_used, sim.host_reserved) == (0, 0)


def test_giving_an_extent_back_twice_is_refused_and_changes_nothing() -> None:
    """The second give of the same extent raises AllocatorError; the chunk's free space is what one give left."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=4 * C))
    first = pinned(arena, arena.take(C))
    second = pinned(arena, arena.take(C))
    arena.give(first)
    free = arena.free_bytes()
    with pytest.raises(AllocatorError, match="given back twice"):
        arena.give(first)
    with pytest.raises(AllocatorError, match="given back twice"):
        arena.give(second + second)  # twice in one call: refused whole, the first copy not applied either
    assert arena.free_bytes() == free == 3 * C
    third = pinned(arena, arena.take(3 * C))
    assert not {e.host for e in third} & {e.host for e in second}, "a live backup's host memory was handed out again"
    arena.give(second + third)
    arena.close()


def test_a_staged_take_leaves_its_chunks_unpinned_until_end_staging() -> None:
    """take(stage=True) reserves without pinning (wait_pinned says False); end_staging pins the used chunks, drops the rest."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=4 * C, threads=2, stage_slot_bytes=C, stage_ring_bytes=2 * C))
    extents = arena.take(6 * C, stage=True)
    assert arena.staging_bytes() == 2 * C and sim.host_used == 0
    assert not any(arena.wait_pinned(e.host) for e in extents)
    assert arena.held_bytes() == 8 * C + 2 * C and arena.pinned_bytes() == 2 * C  # two chunks pending; the ring
    arena.give([e for e in extents if e.chunk != extents[0].chunk])  # the second chunk holds nothing now
    arena.end_staging()
    assert arena.wait_ready(10) and arena.staging_bytes() == 0
    assert arena.pinned_bytes() == 4 * C == sim.host_used and sim.host_reserved == 4 * C
    for e in extents[:1]:
        arena.wait_readable(e.host)
    arena.close()
    assert sim.host_used == 0 == sim.host_reserved


def test_a_staged_take_with_no_room_for_its_ring_pins_as_usual() -> None:
    """Under a limit that fits the chunks but not the ring, a staged take pins its chunks and reserves no ring."""
    sim = SimDriver(granularity=C)
    arena = HostArena(sim, HostPolicy(chunk_bytes=4 * C, limit_bytes=4 * C, stage_slot_bytes=C))
    extents = pinned(arena, arena.take(4 * C, stage=True))
    assert arena.staging_bytes() == 0 and all(arena.wait_pinned(e.host) for e in extents)
    assert sim.host_used == 4 * C
    arena.close()


class SlowUnpin(SimDriver):
    """A SimDriver whose registrations wait for ``registered`` and whose unpins wait for ``unpinned``."""

    def __init__(self) -> None:
        super().__init__(granularity=C)
        self.registered = threading.Event()
        self.unpinned = threading.Event()

    def host_register(self, host: int, nbytes: int) -> None:
        self.registered.wait(10)
        super().host_register(host, nbytes)

    def host_free(self, host: int) -> None:
        self.unpinned.wait(10)
        super().host_free(host)


def test_wait_unpinned_waits_for_a_chunk_trimmed_while_it_was_being_pinned() -> None:
    """A chunk trimmed while its pin ran is unpinned by that thread; wait_unpinned returns only once it is."""
    sim = SlowUnpin()
    arena = HostArena(sim, HostPolicy(chunk_bytes=4 * C, stage_slot_bytes=C, stage_ring_bytes=C))
    extents = arena.take(4 * C, stage=True)
    arena.end_staging()  # the filled chunk is being registered (held at the gate)
    arena.give(extents)
    arena.trim()  # empty, not registered yet: its pinning thread unpins it once registered
    sim.registered.set()
    assert arena.wait_ready(10)
    assert not arena.wait_unpinned(0.2) and sim.host_used == 4 * C  # the unpin is still running
    sim.unpinned.set()
    assert arena.wait_unpinned(10) and sim.host_used == 0 and arena.held_bytes() == 0
    arena.close()
