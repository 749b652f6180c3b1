"""Tests of the sleep/wake cycle (SleepWake) with torch's pools: what a wake maps of segments torch holds free (issue 51)."""

from __future__ import annotations

import pytest
from cachingmodel import ModelStream, Tensor, model_allocator

from torpor import SleepController
from torpor.allocator import TaggedAllocator
from torpor.testrig import GRANULE as G

TAGS = ("weights", "kv_cache")


@pytest.fixture(autouse=True)
def _model_stands_for_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The caching model stands for torch's pools (tests/cachingmodel.py), as on CUDA."""
    monkeypatch.setattr(TaggedAllocator, "on_cuda", property(lambda self: True))
    monkeypatch.setenv("TORPOR_TRIM_FREE_SEGMENTS", "1")


def test_tensors_deleted_while_asleep_are_freed_for_good_over_ten_cycles() -> None:
    """Ten cycles of tensors made in two tags beside live ones and deleted while asleep: the wake maps none of them, and after empty_cache the device holds at most one granule per tag more than at the start."""
    stream = ModelStream()
    alloc, torch = model_allocator(stream, G, capacity=1024 * G)
    ctl = SleepController(alloc)
    kept: list[Tensor] = []
    for tag in TAGS:  # live for good: what the deleted tensors sit beside in the tag's address range
        with alloc.use_memory_pool(tag):
            tensor = torch.malloc(3 * G)
            assert tensor is not None
            torch.write(tensor, 7)
            kept.append(tensor)
    ctl.sleep(1)
    ctl.wake()
    stream.run()
    alloc.empty_cache()
    start = alloc.driver.used
    woke, emptied = [], []
    for cycle in range(10):
        made: list[Tensor] = []
        for tag in TAGS:
            with alloc.use_memory_pool(tag):
                for nbytes in (G // 3, G, 5 * G, 2 * G):
                    tensor = torch.malloc(nbytes)
                    assert tensor is not None
                    torch.write(tensor, cycle + 10)
                    made.append(tensor)
        ctl.sleep(1)
        for tensor in made:  # deleted while asleep: back in their pools' caches, every segment of them free
            torch.free(tensor)
        ctl.wake()
        woke.append(alloc.driver.used - start)
        stream.run()
        alloc.empty_cache()
        emptied.append(alloc.driver.used - start)
    assert max(woke) <= len(TAGS) * G, f"bytes mapped past the start after each wake: {woke}"
    assert emptied[-1] <= len(TAGS) * G, f"bytes mapped past the start after each empty_cache: {emptied}"
    wrong: list[str] = []
    for tensor in kept[:1]:  # weights were backed up: their bytes are back
        torch.read(tensor, wrong)
    stream.run()
    assert wrong == [] and stream.faults == []
    alloc.close()
