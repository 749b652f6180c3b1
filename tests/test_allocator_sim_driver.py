"""Tests of SimDriver: VMM rules, capacity, host memory, fault injection and the call record."""

from __future__ import annotations

import pytest
from simvmm import SimVmm

from torpor.allocator import Driver, DriverError, DriverOutOfMemory, SimDriver
from torpor.errors import OutOfMemory
from torpor.testrig import GRANULE as G


def mapped(sim: SimDriver, nbytes: int = G) -> int:
    """Reserve, create, map and enable ``nbytes``; return the address."""
    vmm = SimVmm(sim)
    va = vmm.reserve(nbytes, 0)
    h = vmm.create(nbytes, 0)
    vmm.map(va, nbytes, h)
    vmm.set_access(va, nbytes, 0)
    vmm.release(h)
    return va


def test_calls_cover_every_driver_method() -> None:
    """The view has a method for each call it makes; the others are the table's VMM calls, none of them in Python."""
    assert set(SimDriver.CALLS) == set(Driver.CALLS)
    for call in SimDriver.VIEW_CALLS:
        assert callable(getattr(SimDriver, call)) and hasattr(SimDriver, "_" + call)
    table = set(SimDriver.CALLS) - set(SimDriver.VIEW_CALLS)
    assert table == {"reserve", "unreserve", "create", "map", "set_access", "unmap", "release"}
    assert not any(hasattr(SimDriver, call) or hasattr(SimDriver, "_" + call) for call in table)


def test_the_view_makes_its_calls_in_the_library() -> None:
    """A copy, an event and a pin go through the library: a copy from an unmapped device range is its error, said there."""
    sim = SimDriver(4 * G, granularity=G)
    host = sim.host_alloc(G)
    with pytest.raises(DriverError, match=r"device range 0x[0-9a-f]+\+65536 is not mapped and accessible") as err:
        sim.copy_d2h(host, SimVmm(sim).reserve(G, 0), G, 0)
    assert err.value.call == "copy_d2h" and err.value.code == 700
    assert sim.record(0) != sim.record(0)
    with pytest.raises(DriverError, match="no simulated device 3") as err:
        sim.record(3)
    assert err.value.call == "device"
    assert sim.mem_info(0) == (4 * G, 4 * G)


def test_bytes_round_trip_through_a_mapping() -> None:
    """Bytes written at a mapped address read back the same."""
    sim = SimDriver(1 << 20, granularity=G)
    va = mapped(sim)
    sim.write(va + 10, b"hello")
    assert sim.read(va + 10, 5) == b"hello"


def test_capacity_is_enforced_as_out_of_memory() -> None:
    """Creating past the capacity raises an out-of-memory driver error."""
    sim = SimDriver(2 * G, granularity=G)
    vmm = SimVmm(sim)
    vmm.create(2 * G, 0)
    with pytest.raises(DriverOutOfMemory) as err:
        vmm.create(G, 0)
    assert isinstance(err.value, OutOfMemory)


def test_release_while_mapped_frees_at_unmap() -> None:
    """A released handle keeps its memory while mapped; the unmap frees it."""
    sim = SimDriver(4 * G, granularity=G)
    va = mapped(sim)
    assert sim.used == G
    SimVmm(sim).unmap(va, G)
    assert sim.used == 0


def test_unmap_needs_the_whole_mapping() -> None:
    """Unmapping part of a mapping is refused, as on CUDA."""
    sim = SimDriver(4 * G, granularity=G)
    vmm = SimVmm(sim)
    va = vmm.reserve(2 * G, 0)
    h = vmm.create(2 * G, 0)
    vmm.map(va, 2 * G, h)
    with pytest.raises(DriverError):
        vmm.unmap(va, G)


def test_a_handle_maps_only_whole() -> None:
    """Mapping part of a handle is refused, as CUDA's cuMemMap (offset must be zero) does."""
    sim = SimDriver(4 * G, granularity=G)
    vmm = SimVmm(sim)
    va = vmm.reserve(2 * G, 0)
    h = vmm.create(2 * G, 0)
    with pytest.raises(DriverError):
        vmm.map(va, G, h)


def test_read_of_unmapped_memory_fails() -> None:
    """Reading an address with no accessible mapping raises."""
    sim = SimDriver(4 * G, granularity=G)
    vmm = SimVmm(sim)
    va = vmm.reserve(G, 0)
    with pytest.raises(DriverError):
        sim.read(va, 1)


def test_host_copies_and_host_capacity() -> None:
    """Copies move bytes both ways; pinning past host capacity is out of memory."""
    sim = SimDriver(4 * G, granularity=G, host_capacity=G)
    va = mapped(sim)
    sim.write(va, b"x" * G)
    host = sim.host_alloc(G)
    sim.copy_d2h(host, va, G, 0)
    sim.write(va, b"y" * G)
    sim.copy_h2d(va, host, G, 0)
    assert sim.read(va, 3) == b"xxx"
    with pytest.raises(DriverOutOfMemory):
        sim.host_alloc(1)
    sim.host_free(host)
    assert sim.host_used == 0


def test_fail_nth_call_then_recover() -> None:
    """fail(call, nth) fails exactly the nth next invocation, records it, then calls succeed again."""
    sim = SimDriver(8 * G, granularity=G)
    vmm = SimVmm(sim)
    sim.fail("create", nth=2)
    vmm.create(G, 0)
    with pytest.raises(DriverError) as err:
        vmm.create(G, 0)
    assert err.value.call == "create"
    vmm.create(G, 0)
    assert [c.failed for c in sim.calls if c.call == "create"] == [False, True, False]
    assert sim.count("create") == 3


def test_fail_times_and_oom_flag() -> None:
    """times repeats the failure; oom=True raises an OutOfMemory."""
    sim = SimDriver(8 * G, granularity=G)
    sim.fail("host_alloc", times=2, oom=True)
    for _ in range(2):
        with pytest.raises(DriverOutOfMemory):
            sim.host_alloc(G)
    sim.host_alloc(G)


def test_fail_unknown_call_is_refused() -> None:
    """Arming a call the driver does not make is a ValueError naming the calls."""
    with pytest.raises(ValueError, match="reserve"):
        SimDriver().fail("nonsense")


def test_clear_faults_disarms() -> None:
    """clear_faults removes armed failures."""
    sim = SimDriver(8 * G, granularity=G)
    vmm = SimVmm(sim)
    sim.fail("reserve")
    sim.clear_faults()
    vmm.reserve(G, 0)


def test_several_devices_have_separate_capacity() -> None:
    """Each simulated device has its own capacity and address range."""
    sim = SimDriver(G, granularity=G, devices=2)
    vmm = SimVmm(sim)
    vmm.create(G, 0)
    vmm.create(G, 1)
    assert sim.used_on(1) == G
    assert vmm.reserve(G, 0) != vmm.reserve(G, 1)
    with pytest.raises(DriverError):
        vmm.create(G, 2)


def test_host_addresses_are_fresh_unless_reuse_is_asked() -> None:
    """By default a given-back host range is never handed out again; with reuse_host the next reservation takes it."""
    fresh = SimDriver()
    a = fresh.host_reserve(4 * G)
    fresh.host_unreserve(a, 4 * G)
    assert fresh.host_reserve(4 * G) != a
    sim = SimDriver(granularity=G, reuse_host=True)
    base = sim.host_reserve(4 * G)
    sim.host_alloc(2 * G, base)
    sim.host_unreserve(base + 2 * G, G)  # a piece of a live reservation goes at once, as munmap does
    assert sim.host_reserve(G) == base + 2 * G
    assert sim.host_reserved == 4 * G
    sim.host_free(base)
    sim.host_unreserve(base + 3 * G, G)
    assert sim.host_reserve(2 * G) == base  # given-back pieces merge
    again = sim.host_alloc(2 * G, base)
    sim.copy_d2h(again, mapped(sim), G, 0)  # the reused range is real memory
    assert sim.host_reserved == 3 * G


def test_two_faults_armed_on_one_call_each_fail_their_own_invocation() -> None:
    """fail(call, 1) and fail(call, 3) armed together fail the 1st and the 3rd invocation (every armed fault counts every call)."""
    sim = SimDriver(1 << 20, granularity=G)
    vmm = SimVmm(sim)
    sim.fail("create", nth=1)
    sim.fail("create", nth=3)
    outcome = []
    for _ in range(4):
        try:
            vmm.create(G, 0)
        except DriverError:
            outcome.append("failed")
        else:
            outcome.append("ok")
    assert outcome == ["failed", "ok", "failed", "ok"]


def test_drop_handles_closes_what_a_failed_release_left() -> None:
    """A release failed on purpose keeps its handle's memory (as a driver would); drop_handles closes it at teardown."""
    sim = SimDriver(4 * G, granularity=G)
    vmm = SimVmm(sim)
    handle = vmm.create(G, 0)
    sim.fail("release")
    with pytest.raises(DriverError):
        vmm.release(handle)
    assert sim.used == G
    assert sim.drop_handles() == 1 and sim.used == 0
    assert sim.drop_handles() == 0


def test_an_out_of_memory_error_says_its_sizes_as_a_person_reads_them() -> None:
    """The simulated device's out-of-memory reason gives sizes (1.00 GiB, 4.00 MiB), not raw byte counts (issue 27)."""
    sim = SimDriver(64 << 20, granularity=2 << 20)
    vmm = SimVmm(sim)
    vmm.create(4 << 20, 0)
    with pytest.raises(DriverOutOfMemory, match=r"cannot create 1\.00 GiB: 4\.00 MiB of 64\.00 MiB in use on device 0"):
        vmm.create(1 << 30, 0)
