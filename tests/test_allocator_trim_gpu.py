"""GPU tests of what a tag gives back: free segments after a block, and only live bytes at sleep (issue 14)."""

from __future__ import annotations

import pytest
import torch

from torpor import SleepController
from torpor.allocator import TaggedAllocator
from torpor.statemachine.events import EventKind

pytestmark = pytest.mark.gpu
MiB = 1 << 20


def _used() -> int:
    """Device memory in use (driver's view) after torch returns its default pool's cache."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_ten_cycles_of_allocate_and_free_give_the_memory_back() -> None:
    """10 cycles of 2 x 256 MiB in a tag, one freed while asleep and one after wake: memory in use ends within 64 MiB of the start, usage() 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("weights"):
        w = torch.randn(1024, 1024, device="cuda")
    w_host = w.cpu()
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
    with alloc.use_memory_pool("scratch"):  # a block ends: the tag's free segments go back
        pass
    end = _used()
    print(f"trim: used at start {start / MiB:.1f} MiB, after 10 cycles {end / MiB:.1f} MiB")
    assert alloc.usage()["scratch"].resident == 0 and alloc.usage()["scratch"].allocations == 0
    assert end - start <= 64 * MiB, f"{(end - start) / MiB:.1f} MiB more in use after 10 cycles"
    assert torch.equal(w.cpu(), w_host)
    alloc.close()


def test_sleep_moves_only_the_live_half_of_each_segment() -> None:
    """A tag whose segments are half freed (torch holds the halves as free blocks): the backup moves the live half, wake is bit-exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("half"):  # 8 MiB tensors: torch puts two in each 20 MiB segment
        pairs = [
            (torch.full((2 * MiB,), i, dtype=torch.int32, device="cuda"), torch.zeros(2 * MiB, device="cuda"))
            for i in range(16)
        ]
        keep = [a for a, _ in pairs]
        del pairs  # the other half of each segment is free now (held by torch's pool)
    torch.cuda.synchronize()
    kept = [t.cpu() for t in keep]
    live = sum(t.numel() * t.element_size() for t in keep)
    resident = alloc.usage()["half"].resident
    ctl.sleep(1)
    moved = [e.data["bytes"] for e in ctl.events() if e.kind is EventKind.TAG_BACKED_UP and e.data["tag"] == "half"]
    ctl.wake()
    print(
        f"live-only sleep: resident {resident / MiB:.0f} MiB, live {live / MiB:.0f} MiB, backed up {moved[-1] / MiB:.0f} MiB"
    )
    assert moved[-1] == live and resident >= 2 * live
    assert all(torch.equal(t.cpu(), k) for t, k in zip(keep, kept, strict=True))
    alloc.close()
