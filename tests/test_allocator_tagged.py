"""Tests of TaggedAllocator on SimDriver: bookkeeping, the memory protocol, rollback, refusals, the graph pool."""

from __future__ import annotations

import threading

import pytest
from simvmm import SimVmm

from torpor import SleepController, State
from torpor.allocator import AllocatorError, HostPolicy, SimDriver, TaggedAllocator
from torpor.errors import MemoryOperationFailed, OutOfMemory, PoolBusy, TorporError, UnknownTag
from torpor.statemachine.core.policy import DEFAULT_POLICY
from torpor.statemachine.core.protocol import GraphPoolMemory, Memory, TagUsage
from torpor.testrig import fill, intact, sim_rig

G = 64 * 1024
MiB = 1 << 20


def make(capacity: int = 64 * MiB, **kw: object) -> tuple[SimDriver, TaggedAllocator]:
    """torpor.testrig's rig: a small simulated device and an allocator batching in 256 KiB."""
    devices = int(kw.pop("devices", 1))  # type: ignore[call-overload]
    slab = int(kw.pop("slab_bytes", 8 * G))  # type: ignore[call-overload]
    policy = HostPolicy(prepin=True, chunk_bytes=MiB, threads=2, prepin_exclude=DEFAULT_POLICY.never_backed_up())
    rig = sim_rig(
        capacity, granularity=G, devices=devices, host=policy, group_bytes=4 * G, piece_bytes=2 * G, slab_bytes=slab
    )
    return rig.driver, rig.allocator


def test_meets_the_memory_protocols() -> None:
    """TaggedAllocator is a Memory and a GraphPoolMemory."""
    _, alloc = make()
    assert isinstance(alloc, Memory) and isinstance(alloc, GraphPoolMemory)


def test_allocate_rounds_up_and_usage_counts() -> None:
    """Sizes round up to the granularity; usage reports resident bytes and allocations per tag."""
    _, alloc = make()
    alloc.allocate(1, "weights")
    alloc.allocate(G + 1, "weights")
    u = alloc.usage()["weights"]
    assert (u.resident, u.allocations) == (3 * G, 2)


def test_tag_allocations_are_adjacent() -> None:
    """Allocations of one tag sit side by side in address space (what batching relies on)."""
    _, alloc = make(slab_bytes=0)
    a = alloc.allocate(G, "w")
    alloc.allocate(G, "kv")
    b = alloc.allocate(2 * G, "w")
    assert b == a + G


def test_free_unmaps_and_returns_the_range() -> None:
    """free() unmaps, returns device memory and the address range is reused."""
    sim, alloc = make()
    a = alloc.allocate(G, "w")
    alloc.free(a)
    assert sim.used == 0 and alloc.usage()["w"].allocations == 0
    assert alloc.allocate(G, "w") == a


def test_free_of_unknown_address_is_refused() -> None:
    """Freeing an address the allocator never gave out raises, naming it."""
    _, alloc = make()
    with pytest.raises(AllocatorError, match="0x1234"):
        alloc.free(0x1234)


def test_use_memory_pool_nests_inner_wins() -> None:
    """allocate() without a tag uses the innermost use_memory_pool tag."""
    _, alloc = make()
    with alloc.use_memory_pool("outer"):
        alloc.allocate(G)
        with alloc.use_memory_pool("inner"):
            alloc.allocate(G)
        alloc.allocate(G)
    u = alloc.usage()
    assert u["outer"].allocations == 2 and u["inner"].allocations == 1


def test_sleep_wake_cycle_keeps_offloaded_bytes_and_releases_all() -> None:
    """backup + release frees every device byte; restore brings the exact bytes back at the same addresses."""
    sim, alloc = make()
    data = fill(alloc, "weights", [G, 3 * G, 5 * G + 7, 2 * G])
    alloc.backup(["weights"])
    alloc.release(["weights"])
    assert sim.used == 0
    assert alloc.usage()["weights"].host == sum(alloc.size_of(a) for a in data)
    alloc.restore(["weights"])
    assert intact(alloc, data)
    alloc.drop_backup(["weights"])
    assert alloc.host.used_bytes() == 0


def test_release_without_backup_discards() -> None:
    """A tag released without a backup is reported discarded and comes back as fresh memory."""
    sim, alloc = make()
    fill(alloc, "kv_cache", [2 * G])
    alloc.release(["kv_cache"])
    assert alloc.usage()["kv_cache"].discarded == 2 * G
    alloc.restore(["kv_cache"])
    assert alloc.usage()["kv_cache"].resident == 2 * G and sim.used == 2 * G


def test_wake_batches_driver_calls() -> None:
    """A wake sets access once per contiguous span and copies once per batch, not once per allocation."""
    sim, alloc = make(slab_bytes=0)
    fill(alloc, "w", [G] * 16)
    alloc.backup(["w"])
    alloc.release(["w"])
    sets, copies = sim.count("set_access"), sim.count("copy_h2d")
    alloc.restore(["w"])
    assert sim.count("set_access") - sets == 4  # 16 adjacent x 64 KiB in spans of 256 KiB: once per span
    assert sim.count("create") == 16 + 4  # one handle per allocation at first, one per span after a wake
    assert sim.count("copy_h2d") - copies == 4  # one copy per batch (one pinned chunk, adjacent addresses)


def test_a_discarded_tag_comes_back_one_mapping_per_allocation_and_a_backed_up_one_in_pieces() -> None:
    """A wake maps a discarded tag's large allocations whole (the next sleep unmaps few) and a backed-up tag's in pieces."""
    sim, alloc = make(slab_bytes=0)
    fill(alloc, "kv_cache", [8 * G, 8 * G])
    data = fill(alloc, "weights", [8 * G])
    alloc.backup(["weights"])
    alloc.release(["kv_cache", "weights"])
    alloc.restore(["kv_cache", "weights"])
    assert alloc.table.stats("kv_cache")[3] == 2  # two allocations, two mappings (not 4 spans of 2 pieces)
    assert alloc.table.stats("weights")[3] == 2  # pieces of 2 granules in spans of 4, each copy enqueued at once
    assert intact(alloc, data) and alloc.usage()["kv_cache"].resident == 16 * G
    unmaps = sim.count("unmap")
    alloc.release(["kv_cache"])
    assert sim.count("unmap") - unmaps == 2


def test_free_in_a_shared_mapping_waits_for_the_last_user_or_the_next_sleep() -> None:
    """After a wake adjacent allocations share a mapping: a free keeps it mapped for the others, and the range comes back later."""
    sim, alloc = make(slab_bytes=0)
    data = fill(alloc, "w", [G] * 4)
    alloc.backup(["w"])
    alloc.release(["w"])
    alloc.restore(["w"])
    alloc.drop_backup(["w"])
    first, *others = list(data)
    alloc.free(first)
    assert sim.used == 4 * G and intact(alloc, {a: data[a] for a in others})
    assert alloc.allocate(G, "w") != first  # still mapped: not reused yet
    alloc.backup(["w"])
    alloc.release(["w"])
    assert sim.used == 0
    alloc.restore(["w"])
    assert intact(alloc, {a: data[a] for a in others})
    assert alloc.allocate(G, "w") == first  # the next sleep gave the range back


def test_one_granule_allocations_share_slabs_that_double_up_to_the_limit() -> None:
    """Sixteen one-granule allocations cost four mappings (slabs of 2, 4, 8 and 8 granules), adjacent inside each."""
    sim, alloc = make(slab_bytes=8 * G)
    data = fill(alloc, "w", [G] * 16)
    assert sim.count("create") == 4 and sim.count("set_access") == 4
    starts = sorted(data)
    assert starts[1] == starts[0] + G and starts[3] == starts[2] + G
    assert alloc.usage()["w"] == TagUsage(16 * G, 0, 0, 16)
    assert sim.used == 22 * G and alloc.slabs.spare_bytes() == 6 * G
    assert alloc.allocate(2 * G, "w") and sim.count("create") == 5  # larger: a mapping of its own


def test_a_freed_slab_granule_is_reused_without_a_driver_call() -> None:
    """A granule freed inside a live slab goes to the next one-granule allocation of the tag, with no driver call."""
    sim, alloc = make(slab_bytes=8 * G)
    data = fill(alloc, "w", [G] * 6)
    first = sorted(data)[2]
    alloc.free(first)
    assert alloc.wait_host_ready(30)  # the pinner's own calls are not the allocation's
    calls = len(sim.calls)
    again = alloc.allocate(G, "w")
    assert again == first and len(sim.calls) == calls
    assert intact(alloc, {a: b for a, b in data.items() if a != first})


def test_a_slab_goes_when_its_last_allocation_is_freed() -> None:
    """Freeing every allocation of a slab unmaps it and returns its device memory; other slabs stay."""
    sim, alloc = make(slab_bytes=8 * G)
    addresses = sorted(fill(alloc, "w", [G] * 3))  # a slab of 2 granules, then one of 4 (1 used)
    alloc.free(addresses[0])
    assert sim.used == 6 * G and alloc.slabs.count() == 2
    alloc.free(addresses[1])
    assert sim.used == 4 * G and alloc.slabs.count() == 1
    alloc.free(addresses[2])
    assert sim.used == 0 and alloc.slabs.count() == 0 and sim.mapped_ranges() == []


def test_sleep_releases_slab_spares_and_wake_maps_only_allocations() -> None:
    """A sleep unmaps whole slabs (spares too); the wake maps the allocations alone and keeps every byte."""
    sim, alloc = make(slab_bytes=8 * G)
    data = fill(alloc, "w", [G] * 5)  # slabs of 2 and 4 granules: 6 mapped, 1 spare
    assert sim.used == 6 * G
    ctl = SleepController(alloc)
    ctl.sleep(1)
    assert sim.used == 0 and alloc.slabs.count() == 0 and sim.count("unmap") == 2
    ctl.wake()
    assert sim.used == 5 * G and intact(alloc, data)
    fresh = alloc.allocate(G, "w")  # a new slab after the wake
    assert fresh not in data and alloc.slabs.count() == 1
    ctl.sleep(1)
    ctl.wake()
    assert intact(alloc, data)


def test_slab_failure_at_creation_leaves_nothing_behind() -> None:
    """A slab whose mapping fails is refused whole: no device memory, no slab, the address range reusable."""
    sim, alloc = make(slab_bytes=8 * G)
    sim.fail("set_access", nth=1)
    with pytest.raises(TorporError):
        alloc.allocate(G, "w")
    assert sim.used == 0 and alloc.slabs.count() == 0
    a = alloc.allocate(G, "w")
    assert alloc.usage()["w"].resident == G and alloc.read(a, 4) == bytes(4)


def test_allocate_into_a_released_tag_is_refused() -> None:
    """An allocation into an asleep tag is refused (it would be half resident)."""
    _, alloc = make()
    fill(alloc, "w", [G])
    alloc.release(["w"])
    with pytest.raises(AllocatorError, match="tag 'w' is asleep; wake it first"):
        alloc.allocate(G, "w")


def test_free_while_asleep_frees_only_the_address_range() -> None:
    """free() of a released allocation makes no unmap call and returns its host backup."""
    sim, alloc = make()
    data = fill(alloc, "w", [G, G])
    alloc.backup(["w"])
    alloc.release(["w"])
    unmaps = sim.count("unmap")
    for a in data:
        alloc.free(a)
    assert sim.count("unmap") == unmaps
    assert alloc.host.used_bytes() == 0
    alloc.restore(["w"])  # an empty tag wakes trivially


def test_unknown_tags_are_refused() -> None:
    """Protocol calls with an unknown tag raise UnknownTag listing the known ones."""
    _, alloc = make()
    fill(alloc, "w", [G])
    for op in (alloc.backup, alloc.release, alloc.restore):
        with pytest.raises(UnknownTag, match="known tags: w"):
            op(["nope"])


@pytest.mark.parametrize("nth", [1, 2])
def test_backup_failure_is_all_or_nothing(nth: int) -> None:
    """A copy failing mid-backup drops every backup of the call and leaves both tags resident."""
    sim, alloc = make()
    fill(alloc, "a", [G] * 3)
    fill(alloc, "b", [G] * 3)
    sim.fail("copy_d2h", nth=nth)
    with pytest.raises(MemoryOperationFailed):
        alloc.backup(["a", "b"])
    u = alloc.usage()
    assert u["a"].resident and u["b"].resident and alloc.host.used_bytes() == 0


def test_backup_host_out_of_memory_is_clean() -> None:
    """Running out of pinned host memory fails the backup with OutOfMemory and keeps nothing."""
    sim = SimDriver(64 * MiB, granularity=G, host_capacity=MiB)
    alloc = TaggedAllocator(sim, host=HostPolicy(prepin=False, chunk_bytes=MiB))
    fill(alloc, "w", [2 * MiB])
    with pytest.raises(OutOfMemory):
        alloc.backup(["w"])
    assert alloc.usage()["w"].resident == 2 * MiB


@pytest.mark.parametrize(("slab", "nth"), [(0, 1), (0, 3), (0, 6), (8 * G, 1), (8 * G, 2)])
def test_release_failure_leaves_the_tag_resident_and_intact(slab: int, nth: int) -> None:
    """An unmap failing mid-release maps back what was unmapped, from the backup: the tag stays whole."""
    sim, alloc = make(slab_bytes=slab)
    data = fill(alloc, "w", [G] * 6)
    alloc.backup(["w"])
    sim.fail("unmap", nth=nth)
    with pytest.raises(MemoryOperationFailed, match="left resident") as failed:
        alloc.release(["w"])
    assert failed.value.reason.endswith("(tag left resident)") and str(failed.value).endswith(failed.value.reason)
    assert alloc.usage()["w"].resident == 6 * G
    assert intact(alloc, data)


@pytest.mark.parametrize("call", ["create", "map", "set_access", "copy_h2d", "record", "wait"])
def test_restore_failure_rolls_back_its_mappings_and_keeps_backups(call: str) -> None:
    """Any driver call failing during restore unmaps what the call mapped; the next restore is exact."""
    sim, alloc = make()
    data = fill(alloc, "w", [G] * 8)
    fill(alloc, "x", [G] * 2)
    alloc.backup(["w", "x"])
    alloc.release(["w", "x"])
    sim.fail(call, nth=2 if call in ("create", "map", "set_access", "copy_h2d") else 1)
    with pytest.raises(TorporError):
        alloc.restore(["x", "w"])
    assert sim.used == 0
    u = alloc.usage()
    assert u["w"].host == 8 * G and u["x"].host == 2 * G
    alloc.restore(["x", "w"])
    assert intact(alloc, data)


def test_wake_out_of_memory_through_the_controller() -> None:
    """A wake that runs out of device memory is an OutOfMemory, the state stays asleep, data survives."""
    sim, alloc = make(capacity=16 * G)
    data = fill(alloc, "weights", [G] * 8)
    ctl = SleepController(alloc)
    ctl.sleep(1)
    hog = SimVmm(sim).create(12 * G, 0)  # another process took the memory
    with pytest.raises(OutOfMemory):
        ctl.wake()
    assert ctl.state is State.ASLEEP_L1 and sim.used == 12 * G
    SimVmm(sim).release(hog)
    ctl.wake()
    assert intact(alloc, data)


def test_controller_cycles_through_levels_and_selective_wakes() -> None:
    """Through SleepController: L1 full, selective both orders, L2 (weights discarded, then reloaded)."""
    sim, alloc = make()
    w = fill(alloc, "weights", [3 * G, 2 * G])
    fill(alloc, "kv_cache", [4 * G])
    rt = fill(alloc, "runtime", [G])
    ctl = SleepController(alloc)
    for level, wakes in ((1, [None]), (1, [["weights"], ["kv_cache"]]), (1, [["kv_cache"], ["weights"]]), (2, [None])):
        ctl.sleep(level)
        assert sim.used == 0
        for tags in wakes:
            ctl.wake(tags)
        assert ctl.state is State.AWAKE
        assert intact(alloc, rt)
        if level == 1:
            assert intact(alloc, w)
    assert alloc.usage()["weights"].resident == 5 * G


def test_fault_matrix_every_call_leaves_a_consistent_allocator() -> None:
    """For each driver call failing once at any point of a cycle, the controller ends awake or asleep with data intact."""
    for call in SimDriver.CALLS:
        for nth in (1, 2):
            sim, alloc = make()
            data = fill(alloc, "weights", [G] * 5)
            ctl = SleepController(alloc)
            sim.fail(call, nth=nth)
            for _ in range(3):
                try:
                    if ctl.state is State.AWAKE:
                        ctl.sleep(1)
                    else:
                        ctl.wake()
                except TorporError:
                    pass
            sim.clear_faults()
            if ctl.state is not State.AWAKE:
                ctl.wake()
            assert intact(alloc, data), (call, nth)


def test_pinned_ahead_before_the_first_sleep() -> None:
    """Pinning ahead covers tagged memory (not kv_cache) so the first backup pins nothing."""
    sim, alloc = make()
    fill(alloc, "weights", [MiB, MiB])
    fill(alloc, "kv_cache", [4 * MiB])
    assert alloc.wait_host_ready(10)
    assert alloc.pinned_bytes() == 2 * MiB
    pins = sim.count("host_alloc")
    alloc.backup(["weights"])
    assert sim.count("host_alloc") == pins


def test_pending_copies_finish_before_free_reuses_memory() -> None:
    """Freeing an allocation with a backup copy in flight waits for it and returns its host extents."""
    _, alloc = make()
    data = fill(alloc, "w", [G] * 8)
    alloc.backup(["w"])
    for a in list(data)[:4]:
        alloc.free(a)
    alloc.release(["w"])
    alloc.restore(["w"])
    assert intact(alloc, dict(list(data.items())[4:]))


def test_allocations_after_backup_are_refused_until_the_backup_goes() -> None:
    """From its backup to its release a tag refuses new allocations (they would lose their bytes); dropping the backup ends that."""
    _, alloc = make()
    data = fill(alloc, "w", [G])
    alloc.backup(["w"])
    with pytest.raises(AllocatorError, match="going to sleep"):
        alloc.allocate(G, "w")
    alloc.drop_backup(["w"])
    alloc.allocate(G, "w")
    assert alloc.usage()["w"].resident == 2 * G and intact(alloc, data)


def test_frees_from_other_threads() -> None:
    """Allocations freed concurrently from several threads leave consistent bookkeeping."""
    sim, alloc = make()
    addrs = [alloc.allocate(G, "runtime") for _ in range(64)]
    threads = [threading.Thread(target=lambda part=addrs[i::4]: [alloc.free(a) for a in part]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert alloc.usage()["runtime"].allocations == 0 and sim.used == 0


def test_several_devices() -> None:
    """Allocations on two devices sleep and wake on their own device."""
    sim, alloc = make(devices=2)
    a = alloc.allocate(G, "w", device=0)
    b = alloc.allocate(G, "w", device=1)
    alloc.write(b, b"z" * G)
    alloc.backup(["w"])
    alloc.release(["w"])
    assert sim.used_on(0) == sim.used_on(1) == 0
    alloc.restore(["w"])
    assert sim.used_on(1) == G and alloc.read(b, 1) == b"z"
    assert a != b


# -- the graph pool ------------------------------------------------------------------------------


class Graph:
    """A stand-in for a captured CUDAGraph."""


def test_capture_creates_one_pool_and_records_sites() -> None:
    """Captures share one pool, tag their allocations cudagraph, call the observer, and holders name the sites."""
    seen: list[tuple[int, int]] = []
    _, alloc = make()
    alloc.on_capture(seen.append)
    graphs = []
    for site in ("batch=8", "batch=16"):
        with alloc.capture_into_pool(site) as handle:
            alloc.allocate(G)
            g = Graph()
            handle.track(g)
            graphs.append(g)
    assert seen[0] == seen[1] == alloc.cudagraph_pool_id()
    assert alloc.usage()["cudagraph"].allocations == 2
    assert alloc.cudagraph_pool_holders() == ["graph captured at batch=8", "graph captured at batch=16"]
    with pytest.raises(PoolBusy) as busy:
        alloc.release_cudagraph_pool()
    assert busy.value.holders == ("graph captured at batch=8", "graph captured at batch=16")
    graphs.clear()
    del g
    assert alloc.release_cudagraph_pool() == 2 * G
    assert alloc.cudagraph_pool_id() is None


def test_pool_release_refused_while_asleep_and_capture_refused_while_asleep() -> None:
    """While the cudagraph tag is released, both release and capture are refused."""
    _, alloc = make()
    with alloc.capture_into_pool("s"):
        alloc.allocate(G)
    alloc.backup(["cudagraph"])
    alloc.release(["cudagraph"])
    with pytest.raises(PoolBusy, match="asleep"):
        alloc.release_cudagraph_pool()
    with pytest.raises(AllocatorError, match="asleep"), alloc.capture_into_pool("late"):
        pass
    alloc.restore(["cudagraph"])
    assert alloc.release_cudagraph_pool() == G


def test_recapture_after_release_keeps_the_pool_size() -> None:
    """Release then recapture five times: a fresh pool each time, the same size each time."""
    _, alloc = make()
    ids, sizes = set(), []
    for i in range(5):
        with alloc.capture_into_pool(f"round {i}"):
            alloc.allocate(3 * G)
        ids.add(alloc.cudagraph_pool_id())
        sizes.append(alloc.usage()["cudagraph"].resident)
        alloc.release_cudagraph_pool()
    assert len(ids) == 5 and set(sizes) == {3 * G}


def test_controller_capture_and_release_through_the_allocator() -> None:
    """SleepController.capture and release_cudagraph_pool drive the allocator's pool."""
    _, alloc = make()
    ctl = SleepController(alloc)
    with ctl.capture("model") as handle:
        alloc.allocate(G)
        g = Graph()
        handle.track(g)  # type: ignore[attr-defined]
    with pytest.raises(PoolBusy, match="model"):
        ctl.release_cudagraph_pool()
    del g
    assert ctl.release_cudagraph_pool() == G


def test_close_while_asleep_frees_everything() -> None:
    """Teardown while asleep: no error, no device or host memory left."""
    sim, alloc = make()
    fill(alloc, "weights", [G] * 3)
    ctl = SleepController(alloc)
    ctl.sleep(1)
    alloc.close()
    assert sim.used == 0 and sim.host_used == 0
    assert not any(True for _ in sim.mapped_ranges())


def test_allocate_into_an_asleep_tag_names_its_state_and_the_sleep_event() -> None:
    """allocate() into an asleep tag is refused like use_memory_pool: TagNotAwake naming the tag, 'asleep' and the sleep's event."""
    from torpor import TagNotAwake

    _, alloc = make()
    fill(alloc, "weights", [2 * G])
    ctl = SleepController(alloc)
    ctl.sleep(1)
    with pytest.raises(
        TagNotAwake, match=r"tag 'weights' is asleep \(sleep level 1, event #\d+ \(sleep_requested\)\)"
    ) as info:
        alloc.allocate(G, "weights")
    assert info.value.operation == "allocate" and info.value.state == "asleep"
    ctl.wake()
    assert alloc.allocate(G, "weights")


def test_write_into_an_asleep_tags_address_names_the_tag_its_state_and_the_sleep_event() -> None:
    """write() at an address of an asleep tag raises TagNotAwake naming the tag, its state and the sleep's event, not a bare DriverError."""
    from torpor import TagNotAwake

    _, alloc = make()
    data = fill(alloc, "kv_cache", [2 * G])
    ctl = SleepController(alloc)
    ctl.sleep(1)
    address = next(iter(data))
    with pytest.raises(TagNotAwake, match=r"tag 'kv_cache' is asleep \(sleep level 1, event #\d+") as info:
        alloc.write(address + 16, b"x" * 8)
    assert info.value.operation == "write" and info.value.tag == "kv_cache"
    assert f"{address + 16:#x}" in str(info.value)
    ctl.wake()
    alloc.write(address, b"y" * 8)
