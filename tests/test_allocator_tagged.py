"""Tests of TaggedAllocator on SimDriver: bookkeeping, the memory protocol, rollback, refusals, the graph pool."""

from __future__ import annotations

import threading

import pytest
from simvmm import SimVmm
from support import RigMaker

from torpor import SleepController, State
from torpor.allocator import AllocatorError, HostPolicy, SimDriver
from torpor.errors import MemoryOperationFailed, OutOfMemory, PoolBusy, TorporError, UnknownTag
from torpor.statemachine.core.protocol import GraphPoolMemory, Memory, TagUsage
from torpor.testrig import GRANULE as G
from torpor.testrig import fill, intact
from torpor.units import MiB


def test_meets_the_memory_protocols(make_rig: RigMaker) -> None:
    """TaggedAllocator is a Memory and a GraphPoolMemory."""
    rig = make_rig("batched")
    assert isinstance(rig.allocator, Memory) and isinstance(rig.allocator, GraphPoolMemory)


def test_allocate_rounds_up_and_usage_counts(make_rig: RigMaker) -> None:
    """Sizes round up to the granularity; usage reports resident bytes and allocations per tag."""
    rig = make_rig("batched")
    rig.allocator.allocate(1, "weights")
    rig.allocator.allocate(G + 1, "weights")
    u = rig.allocator.usage()["weights"]
    assert (u.resident, u.allocations) == (3 * G, 2)


def test_tag_allocations_are_adjacent(make_rig: RigMaker) -> None:
    """Allocations of one tag sit side by side in address space (what batching relies on)."""
    rig = make_rig("batched", slab_bytes=0)
    a = rig.allocator.allocate(G, "w")
    rig.allocator.allocate(G, "kv")
    b = rig.allocator.allocate(2 * G, "w")
    assert b == a + G


def test_free_unmaps_and_returns_the_range(make_rig: RigMaker) -> None:
    """free() unmaps, returns device memory and the address range is reused."""
    rig = make_rig("batched")
    a = rig.allocator.allocate(G, "w")
    rig.allocator.free(a)
    assert rig.driver.used == 0 and rig.allocator.usage()["w"].allocations == 0
    assert rig.allocator.allocate(G, "w") == a


def test_free_of_unknown_address_is_refused(make_rig: RigMaker) -> None:
    """Freeing an address the allocator never gave out raises, naming it."""
    rig = make_rig("batched")
    with pytest.raises(AllocatorError, match="0x1234"):
        rig.allocator.free(0x1234)


def test_use_memory_pool_nests_inner_wins(make_rig: RigMaker) -> None:
    """allocate() without a tag uses the innermost use_memory_pool tag."""
    rig = make_rig("batched")
    with rig.allocator.use_memory_pool("outer"):
        rig.allocator.allocate(G)
        with rig.allocator.use_memory_pool("inner"):
            rig.allocator.allocate(G)
        rig.allocator.allocate(G)
    u = rig.allocator.usage()
    assert u["outer"].allocations == 2 and u["inner"].allocations == 1


def test_sleep_wake_cycle_keeps_offloaded_bytes_and_releases_all(make_rig: RigMaker) -> None:
    """backup + release frees every device byte; restore brings the exact bytes back at the same addresses."""
    rig = make_rig("batched")
    data = fill(rig.allocator, "weights", [G, 3 * G, 5 * G + 7, 2 * G])
    rig.allocator.backup(["weights"])
    rig.allocator.release(["weights"])
    assert rig.driver.used == 0
    assert rig.allocator.usage()["weights"].host == sum(rig.allocator.size_of(a) for a in data)
    rig.allocator.restore(["weights"])
    assert intact(rig.allocator, data)
    rig.allocator.drop_backup(["weights"])
    assert rig.allocator._host.used_bytes() == 0


def test_release_without_backup_discards(make_rig: RigMaker) -> None:
    """A tag released without a backup is reported discarded and comes back as fresh memory."""
    rig = make_rig("batched")
    fill(rig.allocator, "kv_cache", [2 * G])
    rig.allocator.release(["kv_cache"])
    assert rig.allocator.usage()["kv_cache"].discarded == 2 * G
    rig.allocator.restore(["kv_cache"])
    assert rig.allocator.usage()["kv_cache"].resident == 2 * G and rig.driver.used == 2 * G


def test_wake_batches_driver_calls(make_rig: RigMaker) -> None:
    """A wake sets access once per contiguous span and copies once per batch, not once per allocation."""
    rig = make_rig("batched", slab_bytes=0)
    fill(rig.allocator, "w", [G] * 16)
    rig.allocator.backup(["w"])
    rig.allocator.release(["w"])
    sets, copies = rig.driver.count("set_access"), rig.driver.count("copy_h2d")
    rig.allocator.restore(["w"])
    assert rig.driver.count("set_access") - sets == 4  # 16 adjacent x 64 KiB in spans of 256 KiB: once per span
    assert rig.driver.count("create") == 16 + 4  # one handle per allocation at first, one per span after a wake
    assert rig.driver.count("copy_h2d") - copies == 4  # one copy per batch (one pinned chunk, adjacent addresses)


def test_a_discarded_tag_comes_back_one_mapping_per_allocation_and_a_backed_up_one_in_pieces(
    make_rig: RigMaker,
) -> None:
    """A wake maps a discarded tag's large allocations whole (the next sleep unmaps few) and a backed-up tag's in pieces."""
    rig = make_rig("batched", slab_bytes=0)
    fill(rig.allocator, "kv_cache", [8 * G, 8 * G])
    data = fill(rig.allocator, "weights", [8 * G])
    rig.allocator.backup(["weights"])
    rig.allocator.release(["kv_cache", "weights"])
    rig.allocator.restore(["kv_cache", "weights"])
    # two allocations, two mappings (not 4 spans of 2 pieces)
    assert rig.allocator._table.stats("kv_cache").mappings == 2
    # pieces of 2 granules in spans of 4, each copy enqueued at once
    assert rig.allocator._table.stats("weights").mappings == 2
    assert intact(rig.allocator, data) and rig.allocator.usage()["kv_cache"].resident == 16 * G
    unmaps = rig.driver.count("unmap")
    rig.allocator.release(["kv_cache"])
    assert rig.driver.count("unmap") - unmaps == 2


def test_free_in_a_shared_mapping_waits_for_the_last_user_or_the_next_sleep(make_rig: RigMaker) -> None:
    """After a wake adjacent allocations share a mapping: a free keeps it mapped for the others, and the range comes back later."""
    rig = make_rig("batched", slab_bytes=0)
    data = fill(rig.allocator, "w", [G] * 4)
    rig.allocator.backup(["w"])
    rig.allocator.release(["w"])
    rig.allocator.restore(["w"])
    rig.allocator.drop_backup(["w"])
    first, *others = list(data)
    rig.allocator.free(first)
    assert rig.driver.used == 4 * G and intact(rig.allocator, {a: data[a] for a in others})
    assert rig.allocator.allocate(G, "w") != first  # still mapped: not reused yet
    rig.allocator.backup(["w"])
    rig.allocator.release(["w"])
    assert rig.driver.used == 0
    rig.allocator.restore(["w"])
    assert intact(rig.allocator, {a: data[a] for a in others})
    assert rig.allocator.allocate(G, "w") == first  # the next sleep gave the range back


def test_one_granule_allocations_share_slabs_that_double_up_to_the_limit(make_rig: RigMaker) -> None:
    """Sixteen one-granule allocations cost four mappings (slabs of 2, 4, 8 and 8 granules), adjacent inside each."""
    rig = make_rig("batched", slab_bytes=8 * G)
    data = fill(rig.allocator, "w", [G] * 16)
    assert rig.driver.count("create") == 4 and rig.driver.count("set_access") == 4
    starts = sorted(data)
    assert starts[1] == starts[0] + G and starts[3] == starts[2] + G
    assert rig.allocator.usage()["w"] == TagUsage(16 * G, 0, 0, 16)
    assert rig.driver.used == 22 * G and rig.allocator.slabs.spare_bytes() == 6 * G
    assert rig.allocator.allocate(2 * G, "w") and rig.driver.count("create") == 5  # larger: a mapping of its own


def test_a_freed_slab_granule_is_reused_without_a_driver_call(make_rig: RigMaker) -> None:
    """A granule freed inside a live slab goes to the next one-granule allocation of the tag, with no driver call."""
    rig = make_rig("batched", slab_bytes=8 * G)
    data = fill(rig.allocator, "w", [G] * 6)
    first = sorted(data)[2]
    rig.allocator.free(first)
    assert rig.allocator.wait_host_ready(30)  # the pinner's own calls are not the allocation's
    calls = len(rig.driver.calls)
    again = rig.allocator.allocate(G, "w")
    assert again == first and len(rig.driver.calls) == calls
    assert intact(rig.allocator, {a: b for a, b in data.items() if a != first})


def test_a_slab_goes_when_its_last_allocation_is_freed(make_rig: RigMaker) -> None:
    """Freeing every allocation of a slab unmaps it and returns its device memory; other slabs stay."""
    rig = make_rig("batched", slab_bytes=8 * G)
    addresses = sorted(fill(rig.allocator, "w", [G] * 3))  # a slab of 2 granules, then one of 4 (1 used)
    rig.allocator.free(addresses[0])
    assert rig.driver.used == 6 * G and rig.allocator.slabs.count() == 2
    rig.allocator.free(addresses[1])
    assert rig.driver.used == 4 * G and rig.allocator.slabs.count() == 1
    rig.allocator.free(addresses[2])
    assert rig.driver.used == 0 and rig.allocator.slabs.count() == 0 and rig.driver.mapped_ranges() == []


def test_sleep_releases_slab_spares_and_wake_maps_only_allocations(make_rig: RigMaker) -> None:
    """A sleep unmaps whole slabs (spares too); the wake maps the allocations alone and keeps every byte."""
    rig = make_rig("batched", slab_bytes=8 * G)
    data = fill(rig.allocator, "w", [G] * 5)  # slabs of 2 and 4 granules: 6 mapped, 1 spare
    assert rig.driver.used == 6 * G
    ctl = SleepController(rig.allocator)
    ctl.sleep(1)
    assert rig.driver.used == 0 and rig.allocator.slabs.count() == 0 and rig.driver.count("unmap") == 2
    ctl.wake()
    assert rig.driver.used == 5 * G and intact(rig.allocator, data)
    fresh = rig.allocator.allocate(G, "w")  # a new slab after the wake
    assert fresh not in data and rig.allocator.slabs.count() == 1
    ctl.sleep(1)
    ctl.wake()
    assert intact(rig.allocator, data)


def test_slab_failure_at_creation_leaves_nothing_behind(make_rig: RigMaker) -> None:
    """A slab whose mapping fails is refused whole: no device memory, no slab, the address range reusable."""
    rig = make_rig("batched", slab_bytes=8 * G)
    rig.driver.fail("set_access", nth=1)
    with pytest.raises(TorporError):
        rig.allocator.allocate(G, "w")
    assert rig.driver.used == 0 and rig.allocator.slabs.count() == 0
    a = rig.allocator.allocate(G, "w")
    assert rig.allocator.usage()["w"].resident == G and rig.allocator.read(a, 4) == bytes(4)


def test_allocate_into_a_released_tag_is_refused(make_rig: RigMaker) -> None:
    """An allocation into an asleep tag is refused (it would be half resident)."""
    rig = make_rig("batched")
    fill(rig.allocator, "w", [G])
    rig.allocator.release(["w"])
    with pytest.raises(AllocatorError, match="tag 'w' is asleep; wake it first"):
        rig.allocator.allocate(G, "w")


def test_free_while_asleep_frees_only_the_address_range(make_rig: RigMaker) -> None:
    """free() of a released allocation makes no unmap call and returns its host backup."""
    rig = make_rig("batched")
    data = fill(rig.allocator, "w", [G, G])
    rig.allocator.backup(["w"])
    rig.allocator.release(["w"])
    unmaps = rig.driver.count("unmap")
    for a in data:
        rig.allocator.free(a)
    assert rig.driver.count("unmap") == unmaps
    assert rig.allocator._host.used_bytes() == 0
    rig.allocator.restore(["w"])  # an empty tag wakes trivially


def test_unknown_tags_are_refused(make_rig: RigMaker) -> None:
    """Protocol calls with an unknown tag raise UnknownTag listing the known ones."""
    rig = make_rig("batched")
    fill(rig.allocator, "w", [G])
    for op in (rig.allocator.backup, rig.allocator.release, rig.allocator.restore):
        with pytest.raises(UnknownTag, match="known tags: w"):
            op(["nope"])


@pytest.mark.parametrize("nth", [1, 2])
def test_backup_failure_is_all_or_nothing(nth: int, make_rig: RigMaker) -> None:
    """A copy failing mid-backup drops every backup of the call and leaves both tags resident."""
    rig = make_rig("batched")
    fill(rig.allocator, "a", [G] * 3)
    fill(rig.allocator, "b", [G] * 3)
    rig.driver.fail("copy_d2h", nth=nth)
    with pytest.raises(MemoryOperationFailed):
        rig.allocator.backup(["a", "b"])
    u = rig.allocator.usage()
    assert u["a"].resident and u["b"].resident and rig.allocator._host.used_bytes() == 0


def test_backup_host_out_of_memory_is_clean(make_rig: RigMaker) -> None:
    """Running out of pinned host memory fails the backup with OutOfMemory and keeps nothing."""
    rig = make_rig(granularity=G, host_capacity=MiB, host=HostPolicy(prepin=False, chunk_bytes=MiB))
    fill(rig.allocator, "w", [2 * MiB])
    with pytest.raises(OutOfMemory):
        rig.allocator.backup(["w"])
    assert rig.allocator.usage()["w"].resident == 2 * MiB


@pytest.mark.parametrize(("slab", "nth"), [(0, 1), (0, 3), (0, 6), (8 * G, 1), (8 * G, 2)])
def test_release_failure_leaves_the_tag_resident_and_intact(slab: int, nth: int, make_rig: RigMaker) -> None:
    """An unmap failing mid-release maps back what was unmapped, from the backup: the tag stays whole."""
    rig = make_rig("batched", slab_bytes=slab)
    data = fill(rig.allocator, "w", [G] * 6)
    rig.allocator.backup(["w"])
    rig.driver.fail("unmap", nth=nth)
    with pytest.raises(MemoryOperationFailed, match="left resident") as failed:
        rig.allocator.release(["w"])
    assert failed.value.reason.endswith("(tag left resident)") and str(failed.value).endswith(failed.value.reason)
    assert rig.allocator.usage()["w"].resident == 6 * G
    assert intact(rig.allocator, data)


@pytest.mark.parametrize("call", ["create", "map", "set_access", "copy_h2d", "record", "wait"])
def test_restore_failure_rolls_back_its_mappings_and_keeps_backups(call: str, make_rig: RigMaker) -> None:
    """Any driver call failing during restore unmaps what the call mapped; the next restore is exact."""
    rig = make_rig("batched")
    data = fill(rig.allocator, "w", [G] * 8)
    fill(rig.allocator, "x", [G] * 2)
    rig.allocator.backup(["w", "x"])
    rig.allocator.release(["w", "x"])
    rig.driver.fail(call, nth=2 if call in ("create", "map", "set_access", "copy_h2d") else 1)
    with pytest.raises(TorporError):
        rig.allocator.restore(["x", "w"])
    assert rig.driver.used == 0
    u = rig.allocator.usage()
    assert u["w"].host == 8 * G and u["x"].host == 2 * G
    rig.allocator.restore(["x", "w"])
    assert intact(rig.allocator, data)


def test_wake_out_of_memory_through_the_controller(make_rig: RigMaker) -> None:
    """A wake that runs out of device memory is an OutOfMemory, the state stays asleep, data survives."""
    rig = make_rig("batched", capacity=16 * G)
    data = fill(rig.allocator, "weights", [G] * 8)
    ctl = SleepController(rig.allocator)
    ctl.sleep(1)
    hog = SimVmm(rig.driver).create(12 * G, 0)  # another process took the memory
    with pytest.raises(OutOfMemory):
        ctl.wake()
    assert ctl.state is State.ASLEEP_L1 and rig.driver.used == 12 * G
    SimVmm(rig.driver).release(hog)
    ctl.wake()
    assert intact(rig.allocator, data)


def test_controller_cycles_through_levels_and_selective_wakes(make_rig: RigMaker) -> None:
    """Through SleepController: L1 full, selective both orders, L2 (weights discarded, then reloaded)."""
    rig = make_rig("batched")
    w = fill(rig.allocator, "weights", [3 * G, 2 * G])
    fill(rig.allocator, "kv_cache", [4 * G])
    rt = fill(rig.allocator, "runtime", [G])
    ctl = SleepController(rig.allocator)
    for level, wakes in ((1, [None]), (1, [["weights"], ["kv_cache"]]), (1, [["kv_cache"], ["weights"]]), (2, [None])):
        ctl.sleep(level)
        assert rig.driver.used == 0
        for tags in wakes:
            ctl.wake(tags)
        assert ctl.state is State.AWAKE
        assert intact(rig.allocator, rt)
        if level == 1:
            assert intact(rig.allocator, w)
    assert rig.allocator.usage()["weights"].resident == 5 * G


def test_fault_matrix_every_call_leaves_a_consistent_allocator(make_rig: RigMaker) -> None:
    """For each driver call failing once at any point of a cycle, the controller ends awake or asleep with data intact."""
    for call in SimDriver.CALLS:
        for nth in (1, 2):
            rig = make_rig("batched")
            data = fill(rig.allocator, "weights", [G] * 5)
            ctl = SleepController(rig.allocator)
            rig.driver.fail(call, nth=nth)
            for _ in range(3):
                try:
                    if ctl.state is State.AWAKE:
                        ctl.sleep(1)
                    else:
                        ctl.wake()
                except TorporError:
                    pass
            rig.driver.clear_faults()
            if ctl.state is not State.AWAKE:
                ctl.wake()
            assert intact(rig.allocator, data), (call, nth)


def test_pinned_ahead_before_the_first_sleep(make_rig: RigMaker) -> None:
    """Pinning ahead covers tagged memory (not kv_cache) so the first backup pins nothing."""
    rig = make_rig("batched")
    fill(rig.allocator, "weights", [MiB, MiB])
    fill(rig.allocator, "kv_cache", [4 * MiB])
    assert rig.allocator.wait_host_ready(10)
    assert rig.allocator.pinned_bytes() == 2 * MiB
    pins = rig.driver.count("host_alloc")
    rig.allocator.backup(["weights"])
    assert rig.driver.count("host_alloc") == pins


def test_pending_copies_finish_before_free_reuses_memory(make_rig: RigMaker) -> None:
    """Freeing an allocation with a backup copy in flight waits for it and returns its host extents."""
    rig = make_rig("batched")
    data = fill(rig.allocator, "w", [G] * 8)
    rig.allocator.backup(["w"])
    for a in list(data)[:4]:
        rig.allocator.free(a)
    rig.allocator.release(["w"])
    rig.allocator.restore(["w"])
    assert intact(rig.allocator, dict(list(data.items())[4:]))


def test_allocations_after_backup_are_refused_until_the_backup_goes(make_rig: RigMaker) -> None:
    """From its backup to its release a tag refuses new allocations (they would lose their bytes); dropping the backup ends that."""
    rig = make_rig("batched")
    data = fill(rig.allocator, "w", [G])
    rig.allocator.backup(["w"])
    with pytest.raises(AllocatorError, match="going to sleep"):
        rig.allocator.allocate(G, "w")
    rig.allocator.drop_backup(["w"])
    rig.allocator.allocate(G, "w")
    assert rig.allocator.usage()["w"].resident == 2 * G and intact(rig.allocator, data)


def test_frees_from_other_threads(make_rig: RigMaker) -> None:
    """Allocations freed concurrently from several threads leave consistent bookkeeping."""
    rig = make_rig("batched")
    addrs = [rig.allocator.allocate(G, "runtime") for _ in range(64)]
    threads = [
        threading.Thread(target=lambda part=addrs[i::4]: [rig.allocator.free(a) for a in part]) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rig.allocator.usage()["runtime"].allocations == 0 and rig.driver.used == 0


def test_several_devices(make_rig: RigMaker) -> None:
    """Allocations on two devices sleep and wake on their own device."""
    rig = make_rig("batched", devices=2)
    a = rig.allocator.allocate(G, "w", device=0)
    b = rig.allocator.allocate(G, "w", device=1)
    rig.allocator.write(b, b"z" * G)
    rig.allocator.backup(["w"])
    rig.allocator.release(["w"])
    assert rig.driver.used_on(0) == rig.driver.used_on(1) == 0
    rig.allocator.restore(["w"])
    assert rig.driver.used_on(1) == G and rig.allocator.read(b, 1) == b"z"
    assert a != b


# -- the graph pool ------------------------------------------------------------------------------


class Graph:
    """A stand-in for a captured CUDAGraph."""


def test_capture_creates_one_pool_and_records_sites(make_rig: RigMaker) -> None:
    """Captures share one pool, tag their allocations cudagraph, call the observer, and holders name the sites."""
    seen: list[tuple[int, int]] = []
    rig = make_rig("batched")
    rig.allocator.on_capture(seen.append)
    graphs = []
    for site in ("batch=8", "batch=16"):
        with rig.allocator.capture_into_pool(site) as handle:
            rig.allocator.allocate(G)
            g = Graph()
            handle.track(g)
            graphs.append(g)
    assert seen[0] == seen[1] == rig.allocator.cudagraph_pool_id()
    assert rig.allocator.usage()["cudagraph"].allocations == 2
    assert rig.allocator.cudagraph_pool_holders() == ["graph captured at batch=8", "graph captured at batch=16"]
    with pytest.raises(PoolBusy) as busy:
        rig.allocator.release_cudagraph_pool()
    assert busy.value.holders == ("graph captured at batch=8", "graph captured at batch=16")
    graphs.clear()
    del g
    assert rig.allocator.release_cudagraph_pool() == 2 * G
    assert rig.allocator.cudagraph_pool_id() is None


def test_pool_release_refused_while_asleep_and_capture_refused_while_asleep(make_rig: RigMaker) -> None:
    """While the cudagraph tag is released, both release and capture are refused."""
    rig = make_rig("batched")
    with rig.allocator.capture_into_pool("s"):
        rig.allocator.allocate(G)
    rig.allocator.backup(["cudagraph"])
    rig.allocator.release(["cudagraph"])
    with pytest.raises(PoolBusy, match="asleep"):
        rig.allocator.release_cudagraph_pool()
    with pytest.raises(AllocatorError, match="asleep"), rig.allocator.capture_into_pool("late"):
        pass
    rig.allocator.restore(["cudagraph"])
    assert rig.allocator.release_cudagraph_pool() == G


def test_recapture_after_release_keeps_the_pool_size(make_rig: RigMaker) -> None:
    """Release then recapture five times: a fresh pool each time, the same size each time."""
    rig = make_rig("batched")
    ids, sizes = set(), []
    for i in range(5):
        with rig.allocator.capture_into_pool(f"round {i}"):
            rig.allocator.allocate(3 * G)
        ids.add(rig.allocator.cudagraph_pool_id())
        sizes.append(rig.allocator.usage()["cudagraph"].resident)
        rig.allocator.release_cudagraph_pool()
    assert len(ids) == 5 and set(sizes) == {3 * G}


def test_controller_capture_and_release_through_the_allocator(make_rig: RigMaker) -> None:
    """SleepController.capture and release_cudagraph_pool drive the allocator's pool."""
    rig = make_rig("batched")
    ctl = SleepController(rig.allocator)
    with ctl.capture("model") as handle:
        rig.allocator.allocate(G)
        g = Graph()
        handle.track(g)  # type: ignore[attr-defined]
    with pytest.raises(PoolBusy, match="model"):
        ctl.release_cudagraph_pool()
    del g
    assert ctl.release_cudagraph_pool() == G


def test_close_while_asleep_frees_everything(make_rig: RigMaker) -> None:
    """Teardown while asleep: no error, no device or host memory left."""
    rig = make_rig("batched")
    fill(rig.allocator, "weights", [G] * 3)
    ctl = SleepController(rig.allocator)
    ctl.sleep(1)
    rig.allocator.close()
    assert rig.driver.used == 0 and rig.driver.host_used == 0
    assert not any(True for _ in rig.driver.mapped_ranges())


def test_allocate_into_an_asleep_tag_names_its_state_and_the_sleep_event(make_rig: RigMaker) -> None:
    """allocate() into an asleep tag is refused like use_memory_pool: TagNotAwake naming the tag, 'asleep' and the sleep's event."""
    from torpor import TagNotAwake

    rig = make_rig("batched")
    fill(rig.allocator, "weights", [2 * G])
    ctl = SleepController(rig.allocator)
    ctl.sleep(1)
    with pytest.raises(
        TagNotAwake, match=r"tag 'weights' is asleep \(sleep level 1, event #\d+ \(sleep_requested\)\)"
    ) as info:
        rig.allocator.allocate(G, "weights")
    assert info.value.operation == "allocate" and info.value.state == "asleep"
    ctl.wake()
    assert rig.allocator.allocate(G, "weights")


def test_write_into_an_asleep_tags_address_names_the_tag_its_state_and_the_sleep_event(make_rig: RigMaker) -> None:
    """write() at an address of an asleep tag raises TagNotAwake naming the tag, its state and the sleep's event, not a bare DriverError."""
    from torpor import TagNotAwake

    rig = make_rig("batched")
    data = fill(rig.allocator, "kv_cache", [2 * G])
    ctl = SleepController(rig.allocator)
    ctl.sleep(1)
    address = next(iter(data))
    with pytest.raises(TagNotAwake, match=r"tag 'kv_cache' is asleep \(sleep level 1, event #\d+") as info:
        rig.allocator.write(address + 16, b"x" * 8)
    assert info.value.operation == "write" and info.value.tag == "kv_cache"
    assert f"{address + 16:#x}" in str(info.value)
    ctl.wake()
    rig.allocator.write(address, b"y" * 8)
