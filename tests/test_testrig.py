"""Tests of torpor.testrig: the simulated-device rig (driver, allocator, controller), fill() and intact(); the tests' make_rig fixture over it."""

from __future__ import annotations

import random

import pytest
from support import RIG_PRESETS, G, RigMaker

from torpor import State
from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
from torpor.errors import AllocatorError, OutOfMemory
from torpor.testrig import CAPACITY, GRANULE, fill, intact, sim_rig
from torpor.units import MiB


def test_the_default_rig_is_a_64_mib_device_of_64_kib_granules() -> None:
    """sim_rig() maps one byte as one 64 KiB granule, on a device of 64 MiB with nothing else in use."""
    with sim_rig() as rig:
        assert rig.driver.mem_info(0) == (CAPACITY, CAPACITY) == (64 * MiB, 64 * MiB)
        address = rig.allocator.allocate(1, "weights")
        assert rig.allocator.size_of(address) == GRANULE == 64 * 1024
        assert rig.allocator.driver is rig.driver and rig.controller is None


def test_the_device_options_reach_the_driver() -> None:
    """capacity, granularity, overhead and devices make the device they say."""
    with sim_rig(16 * MiB, granularity=16 * 1024, overhead=3 * MiB, devices=2) as rig:
        assert rig.driver.mem_info(1) == (13 * MiB, 16 * MiB)
        assert rig.allocator.size_of(rig.allocator.allocate(1, "w", device=1)) == 16 * 1024
        with pytest.raises(AllocatorError):
            rig.allocator.allocate(1, "w", device=2)


def test_host_capacity_bounds_what_a_backup_can_pin() -> None:
    """A backup larger than host_capacity fails out of memory and leaves the tag resident."""
    with sim_rig(host_capacity=MiB, host=HostPolicy(prepin=False, chunk_bytes=MiB)) as rig:
        fill(rig.allocator, "w", [2 * MiB])
        with pytest.raises(OutOfMemory):
            rig.allocator.backup(["w"])
        assert rig.allocator.usage()["w"].resident == 2 * MiB


@pytest.mark.parametrize("reuse", [False, True])
def test_reuse_host_hands_a_given_back_host_range_out_again(reuse: bool) -> None:
    """reuse_host=True: the next host reservation takes the range given back; by default it is a fresh one."""
    with sim_rig(reuse_host=reuse) as rig:
        first = rig.driver.host_reserve(4 * GRANULE)
        rig.driver.host_unreserve(first, 4 * GRANULE)
        assert (rig.driver.host_reserve(4 * GRANULE) == first) is reuse


def test_the_allocator_options_reach_the_allocator_and_none_keeps_its_defaults() -> None:
    """group_bytes, piece_bytes, slab_bytes and host are the allocator's; left out, they are TaggedAllocator's own."""
    policy = HostPolicy(prepin=False, chunk_bytes=MiB, threads=1)
    with sim_rig(host=policy, group_bytes=4 * GRANULE, piece_bytes=2 * GRANULE, slab_bytes=0) as rig:
        cycle = rig.allocator._cycle  # the sleep/wake cycle holds them
        assert (cycle.group_bytes, cycle.piece_bytes) == (4 * GRANULE, 2 * GRANULE)
        assert rig.allocator._host.policy is policy
        rig.allocator.allocate(GRANULE, "w")
        assert rig.allocator.slabs.count() == 0  # slab_bytes=0: each allocation mapped on its own
    plain = TaggedAllocator(SimDriver(CAPACITY, granularity=GRANULE))
    with sim_rig() as rig:
        cycle, default = rig.allocator._cycle, plain._cycle
        assert (cycle.group_bytes, cycle.piece_bytes) == (default.group_bytes, default.piece_bytes)
        rig.allocator.allocate(GRANULE, "w")
        assert rig.allocator.slabs.count() == 1  # the default slabs share one-granule allocations
    plain.close()


def test_a_driver_given_is_used_as_built() -> None:
    """driver=: the rig's allocator runs on that driver (a subclass that injects its own fault), not on a new one."""

    class NoCopyOut(SimDriver):
        def copy_d2h(self, *args: object, **kwargs: object) -> None:
            msg = "this device copies nothing out"
            raise RuntimeError(msg)

    driver = NoCopyOut(8 * MiB, granularity=GRANULE)
    with sim_rig(capacity=CAPACITY, driver=driver) as rig:
        assert rig.driver is driver and rig.allocator.driver is driver
        assert rig.driver.mem_info(0) == (8 * MiB, 8 * MiB)


def test_control_puts_a_controller_over_the_allocator_with_its_options(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """control(**options): a SleepController over the rig's allocator, kept as controller; a cycle keeps fill()'s bytes."""
    with sim_rig(host=HostPolicy(chunk_bytes=4 * GRANULE, threads=1), slab_bytes=0) as rig:
        ctl = rig.control(log=tmp_path / "events.jsonl", engine="rig")
        assert rig.controller is ctl and ctl.memory is rig.allocator and ctl.engine == "rig"
        data = fill(rig.allocator, "weights", [GRANULE, 3 * GRANULE])
        ctl.sleep(1)
        assert rig.allocator.usage()["weights"].resident == 0
        ctl.wake()
        assert ctl.state is State.AWAKE and intact(rig.allocator, data)
    assert (tmp_path / "events.jsonl").read_text().count("\n") > 4


def test_a_fault_armed_at_the_driver_fails_the_allocator_call_once() -> None:
    """rig.driver.fail('create', oom=True): the next allocation fails out of memory, the one after it succeeds."""
    with sim_rig() as rig:
        rig.driver.fail("create", oom=True)
        with pytest.raises(OutOfMemory):
            rig.allocator.allocate(GRANULE, "w")
        rig.allocator.allocate(GRANULE, "w")
        assert rig.allocator.usage()["w"].allocations == 1


def test_close_closes_the_controller_and_frees_the_device_and_the_pinned_host() -> None:
    """close() (or leaving the with block): the controller is closed, nothing stays mapped or pinned."""
    rig = sim_rig(host=HostPolicy(chunk_bytes=4 * GRANULE, threads=1))
    ctl = rig.control()
    fill(rig.allocator, "weights", [4 * GRANULE])
    ctl.sleep(1)
    ctl.wake()  # the backup's pinned chunk is kept after the wake
    assert rig.driver.used == 4 * GRANULE == rig.driver.host_used
    with rig as same:
        assert same is rig
    assert ctl.closed and rig.driver.used == 0 == rig.driver.host_used


def test_fill_writes_random_bytes_over_each_whole_allocation() -> None:
    """fill() rounds each size up as the allocator does and writes that many bytes; each address reads them back."""
    with sim_rig() as rig:
        data = fill(rig.allocator, "kv", [1, GRANULE, GRANULE + 1])
        assert [len(b) for b in data.values()] == [GRANULE, GRANULE, 2 * GRANULE]
        assert rig.allocator.usage()["kv"].allocations == 3
        assert all(rig.allocator.read(a, len(b)) == b for a, b in data.items())
        assert len(set(data.values())) == 3


def test_fill_draws_from_a_seeded_rng_when_given_one() -> None:
    """rng=random.Random(seed): the same seed writes the same bytes."""
    with sim_rig() as one, sim_rig() as two:
        a = fill(one.allocator, "w", [GRANULE, 2 * GRANULE], rng=random.Random(7))
        b = fill(two.allocator, "w", [GRANULE, 2 * GRANULE], rng=random.Random(7))
        assert list(a.values()) == list(b.values())


def test_intact_is_false_once_one_byte_changed() -> None:
    """intact() holds right after fill() and fails when one byte of one allocation differs."""
    with sim_rig() as rig:
        data = fill(rig.allocator, "w", [GRANULE, GRANULE])
        assert intact(rig.allocator, data)
        last = max(data)
        rig.allocator.write(last + 5, bytes([data[last][5] ^ 0xFF]))
        assert not intact(rig.allocator, data)


# -- the make_rig fixture (tests/conftest.py) and its presets (tests/support.py) --------------------------------


def test_make_rig_builds_a_preset_with_the_changes_named(make_rig: RigMaker) -> None:
    """make_rig(preset, **changes, host_options=...): the preset's device and allocator, the named keywords and policy fields replaced."""
    rig = make_rig("staged", capacity=16 * MiB, host_options={"stage_threads": 1})
    assert rig.driver.mem_info(0) == (16 * MiB, 16 * MiB)
    policy = rig.allocator._host.policy
    assert (policy.chunk_bytes, policy.stage_slot_bytes, policy.stage_ring_bytes) == (8 * G, G, 4 * G)
    assert policy.stage_threads == 1 and RIG_PRESETS["staged"]["host"].stage_threads == 3
    rig.allocator.allocate(G, "w")
    assert rig.allocator.slabs.count() == 0


def test_make_rig_refuses_an_unknown_preset_naming_the_presets(make_rig: RigMaker) -> None:
    """A preset that does not exist is a KeyError that lists the ones that do."""
    with pytest.raises(KeyError, match="no rig preset 'stagged'; the presets are default, batched, "):
        make_rig("stagged")


def test_make_rig_closes_every_rig_at_teardown_with_faults_still_armed() -> None:
    """RigMaker.close (the fixture's teardown): each rig's controller closed, its device and pinned host freed, armed faults disarmed."""
    maker = RigMaker()
    one, two = maker("with_context"), maker("small_batches")
    ctl = one.control()
    fill(one.allocator, "weights", [4 * G])
    ctl.sleep(1)
    ctl.wake()  # pinned host memory kept after the wake
    fill(two.allocator, "w", [GRANULE])
    two.driver.fail("unmap")
    two.driver.fail("host_free")
    maker.close()
    assert ctl.closed and not maker.made
    assert one.driver.used == 0 == one.driver.host_used
    assert two.driver.used == 0 == two.driver.host_used
