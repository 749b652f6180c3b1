"""GPU tests of what a tag gives back while awake: free segments at a block's end, on re-entry and before a sleep (issue 14)."""

from __future__ import annotations

import pytest

from torpor import SleepController
from torpor.allocator import TaggedAllocator
from torpor.units import GiB, MiB

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="needs torch (the cuda extra) and a CUDA GPU")


@pytest.fixture(autouse=True)
def _trimming_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about trimming (on by default; set here so that a user's environment cannot turn it off)."""
    monkeypatch.setenv("TORPOR_TRIM_FREE_SEGMENTS", "1")


def _used() -> int:
    """Device memory in use (the driver's view) after torch returns its default pool's cache."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_a_tag_with_no_live_tensor_uses_nothing_once_its_block_ends() -> None:
    """Tensors made and freed inside a block: usage() of the tag is 0 and the device memory is back when the block ends."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    with alloc.use_memory_pool("warm"):  # the pools' first use (contexts, streams): not this test's subject
        torch.ones(1, device="cuda")
    start = _used()
    with alloc.use_memory_pool("scratch"):
        a = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        assert alloc.usage()["scratch"].resident >= 259 * MiB
        del a, b
    assert alloc.usage()["scratch"].resident == 0 and alloc.usage()["scratch"].allocations == 0
    assert _used() - start <= 8 * MiB
    alloc.close()


def test_ten_cycles_of_allocate_and_free_give_the_memory_back() -> None:
    """10 cycles of 2 x 256 MiB in a tag, one freed while asleep and one after wake: memory in use ends within 64 MiB of the start, usage() 0.

    Before the start: one sleep and wake and the test's kernels on the default pool, so that
    the copy stream, pinned host memory and lazily loaded kernels (no tag's memory) are made.
    """
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("weights"):
        w = torch.randn(1024, 1024, device="cuda")
    w_host = w.cpu()
    probe = torch.full((1024,), 1.0, device="cuda")
    assert torch.equal(probe[:16].cpu(), torch.full((16,), 1.0))
    ctl.sleep(1)
    ctl.wake()
    del probe
    start = _used()
    for i in range(10):
        with alloc.use_memory_pool("scratch"):
            x = torch.full((256 * MiB // 4,), float(i), device="cuda")
            y = torch.full((256 * MiB // 4,), float(-i), device="cuda")
        ctl.sleep(1)
        del x  # freed while asleep
        ctl.wake()
        assert torch.equal(y[:1024].cpu(), torch.full((1024,), float(-i)))
        del y  # freed after the wake
    with alloc.use_memory_pool("scratch"):  # a block of the tag is entered again: the free segments go back
        pass
    end = _used()
    mem = alloc.device_memory()
    counts = alloc._torch.current.blocks.counts()
    print(
        f"trim: in use at start {start / MiB:.1f} MiB, after 10 cycles {end / MiB:.1f} MiB "
        f"(+{(end - start) / MiB:.1f}); tagged {mem.tagged / MiB:.1f} MiB; torch default pool "
        f"{torch.cuda.memory_reserved() / MiB:.1f} MiB; pools (all, open) {counts}; "
        f"trimmed {alloc._torch.current.blocks.trimmed_bytes / MiB:.0f} MiB in all"
    )
    assert alloc.usage()["scratch"].resident == 0 and alloc.usage()["scratch"].allocations == 0
    assert end - start <= 64 * MiB, f"{(end - start) / MiB:.1f} MiB more in use after 10 cycles"
    assert torch.equal(w.cpu(), w_host)
    alloc.close()


def test_free_segments_go_before_a_sleep_and_do_not_come_back_on_wake() -> None:
    """A tensor freed after its block: the sleep neither copies nor maps back its segment; the live tensor wakes bit-exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("kv"):
        keep = torch.arange(64 * MiB // 4, dtype=torch.int32, device="cuda")
        gone = torch.ones(128 * MiB // 4, device="cuda")
    kept = keep.cpu()
    del gone  # after the block: its segment is free in a pool no block uses
    ctl.sleep(1)
    moved = ctl.events()[-1]
    ctl.wake()
    resident = alloc.usage()["kv"].resident
    print(f"before a sleep: kv resident after wake {resident / MiB:.0f} MiB; last sleep event {moved.kind}")
    assert resident < 128 * MiB
    assert torch.equal(keep.cpu(), kept)
    alloc.close()


def test_a_block_of_a_sleeping_tag_is_refused_and_after_the_wake_its_cached_segment_is_mapped_again() -> None:
    """A block of a sleeping tag raises TagNotAwake before torch can hand out its (trimmed, unmapped) cache; after the wake the same block gets that segment back, mapped."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torpor import TagNotAwake

    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("weights"):
        w = torch.full((1024,), 5.0, device="cuda")
    with alloc.use_memory_pool("scratch"):
        t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        address = t.data_ptr()
        del t
    torch.cuda.synchronize()
    alloc._torch.pools().trim(["scratch"], settled=True)
    assert alloc.usage()["scratch"].resident == 0  # the free segment was trimmed
    ctl.sleep(1)
    with pytest.raises(TagNotAwake, match="'scratch' is asleep"), alloc.use_memory_pool("scratch"):
        pytest.fail("a block of a sleeping tag must not open")
    ctl.wake()
    with alloc.use_memory_pool("scratch"):  # torch hands out its cached segment: untrimmed (mapped) first
        u = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    assert u.data_ptr() == address
    u.fill_(3)
    torch.cuda.synchronize()
    assert int(u[:1024].sum()) == 3 * 1024 and int(u[-1024:].sum()) == 3 * 1024
    assert float(w.sum()) == 5.0 * 1024
    assert alloc.usage()["scratch"].resident >= 64 * MiB
    del u
    alloc.close()


def _fill_device_leaving(room: int) -> torch.Tensor:
    """A tensor in torch's own pool that leaves about ``room`` bytes of the device free (what the test may use)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free <= room + 256 * MiB:
        pytest.skip(f"needs {(room + 256 * MiB) / GiB:.2f} GiB free on the device, {free / GiB:.2f} GiB are")
    return torch.empty(free - room, dtype=torch.uint8, device="cuda")


def test_an_allocation_under_pressure_waits_for_the_stream_of_a_freed_segment_and_gets_its_memory() -> None:
    """A 1 GiB tensor freed in a tag while a kernel on it is queued, then 1.25 GiB in that tag with room for one of them: it succeeds, the queued kernel ran on mapped memory, every byte is right."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    with alloc.use_memory_pool("warm"):  # contexts, streams and kernels loaded: not this test's subject
        torch.ones(1, device="cuda").add_(1)
    filler = _fill_device_leaving(GiB + 640 * MiB)  # 1 GiB fits, 1.25 GiB fits, both (2.25 GiB) do not
    with alloc.use_memory_pool("scratch"):
        x = torch.zeros(GiB, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(2_000_000_000)  # about a second of device time queued ahead of the next kernel
        x.add_(3)  # a kernel on x, still queued when x is freed
        # its result, read after the wait: x was mapped when it ran (min and max, not a sum: sum(dtype=int64)
        # of 1 GiB of uint8 makes an 8 GiB int64 copy in this tag first, which the room left here cannot hold)
        low, high = x.min(), x.max()
        del x
    with alloc.use_memory_pool("scratch"):
        y = torch.full((GiB + GiB // 4,), 7, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    assert int(low.item()) == 3 and int(high.item()) == 3
    assert int(y.min().item()) == 7 and int(y.max().item()) == 7 and y.numel() == GiB + GiB // 4
    assert alloc.pending_errors() == []
    del y, filler
    alloc.close()


def test_torch_empty_cache_gives_back_a_tags_free_segment_freed_outside_a_block() -> None:
    """A tensor made in a block and freed after it: torch.cuda.empty_cache() gives its segment back at once (no next block or sleep needed)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    with alloc.use_memory_pool("warm"):
        torch.ones(1, device="cuda")
    start = _used()
    with alloc.use_memory_pool("scratch"):
        t = torch.ones(256 * MiB // 4, device="cuda")
    t.add_(1)  # a kernel queued on it after its block
    del t  # freed outside any block: its segment is free in an idle pool
    torch.cuda.empty_cache()  # the call torch users make (torpor's hook trims the idle pools after torch's own)
    free, total = torch.cuda.mem_get_info()
    assert total - free - start <= 8 * MiB, f"{(total - free - start) / MiB:.1f} MiB still in use after empty_cache()"
    assert alloc.usage()["scratch"].resident == 0
    with alloc.use_memory_pool("scratch"):  # the pool serves a block again: its segment is mapped again
        again = torch.full((256 * MiB // 4,), 5.0, device="cuda")
    assert float(again.sum().item()) == 5.0 * (256 * MiB // 4)
    del again
    alloc.close()


def test_ten_cycles_freed_outside_a_block_are_given_back_by_empty_cache() -> None:
    """Ten cycles of 2 x 256 MiB (one freed while asleep, one after the wake), each followed by torch.cuda.empty_cache() and no further block, add at most 64 MiB in use."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("weights"):
        w = torch.randn(1024, 1024, device="cuda")
    w_host = w.cpu()
    ctl.sleep(1)
    ctl.wake()
    used = []
    for i in range(11):  # cycle 0 loads the kernels it launches (lazy module loading takes device memory)
        with alloc.use_memory_pool("scratch"):
            x = torch.full((256 * MiB // 4,), float(i), device="cuda")
            y = torch.full((256 * MiB // 4,), float(-i), device="cuda")
        ctl.sleep(1)
        del x
        ctl.wake()
        assert torch.equal(y[:1024].cpu(), torch.full((1024,), float(-i)))
        del y
        used.append(_used())  # torch.cuda.empty_cache() inside, and no block of the tag after the last free
    grown = [round((u - used[0]) / MiB, 1) for u in used]
    print(f"MiB in use after each cycle, against the first: {grown}; scratch {alloc.usage()['scratch']}")
    assert used[-1] - used[0] <= 64 * MiB, (
        f"{grown[-1]} MiB more in use after 10 more cycles and empty_cache(): {grown}"
    )
    assert torch.equal(w.cpu(), w_host)
    alloc.close()


def test_tensors_deleted_while_asleep_are_freed_for_good_over_ten_cycles() -> None:
    """Ten cycles of tensors of five sizes in three tags beside live ones, deleted while asleep: the wake maps none of them, and after torch.cuda.empty_cache() the device holds at most one granule per tag more than after the first cycle (issue 51)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    tags = ("weights", "kv_cache", "scratch")
    with alloc.use_memory_pool("weights"):
        w = [torch.randn(n, device="cuda") for n in (64 * MiB // 4, 3 * MiB // 4, 1000, 5 * MiB // 4)]
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.full((128 * MiB // 4,), 2.0, device="cuda")
    w_host = [t.cpu() for t in w]
    sizes = (1000, 300_000, 3 * MiB // 4, 30 * MiB // 4, 100 * MiB // 4)
    ctl.sleep(1)
    ctl.wake()
    torch.cuda.empty_cache()
    live = alloc._table.stats().mapped  # bytes the tags map for their live tensors
    woke, emptied = [], []
    for i in range(11):  # cycle 0 loads the kernels it launches (lazy module loading takes device memory)
        made = []
        for tag in tags:
            with alloc.use_memory_pool(tag):
                made += [torch.full((n,), float(i), device="cuda") for n in sizes]
        ctl.sleep(1)
        del made  # deleted while asleep: every segment of them is free in its pool
        ctl.wake()
        woke.append(alloc._table.stats().mapped)  # bytes the tags map after the wake
        emptied.append(_used())  # torch.cuda.empty_cache() inside
    gran = alloc.granularity()
    grown = [round((u - emptied[0]) / MiB, 1) for u in emptied]
    mapped = [round((m - live) / MiB, 1) for m in woke]
    print(f"mapped past the live tensors after each wake (MiB): {mapped}; in use after empty_cache: {grown}")
    assert max(woke) - live <= len(tags) * gran, f"the wakes mapped deleted tensors' segments (MiB): {mapped}"
    assert emptied[-1] - emptied[0] <= len(tags) * gran, f"{grown[-1]} MiB more in use after 10 cycles: {grown}"
    assert all(torch.equal(t.cpu(), h) for t, h in zip(w, w_host, strict=True))
    assert float(kv[:1024].sum()) in (0.0, 2.0 * 1024)  # kv_cache is discarded at level 1: zeros or its bytes
    alloc.close()
