"""GPU test of what a sleep copies: only the blocks torch's pool holds in use (issue 14)."""

from __future__ import annotations

import pytest

from torpor import SleepController
from torpor.allocator import TaggedAllocator
from torpor.statemachine.core.events import EventKind
from torpor.units import MiB

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="needs torch (the cuda extra) and a CUDA GPU")


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
