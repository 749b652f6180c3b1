"""Tests of torpor.allocator.torchside.binding: torch's pools are made once, at the first use, and not before."""

from __future__ import annotations

import threading

import pytest
from support import RigMaker

from torpor.allocator.torchside.binding import TorchBinding
from torpor.units import MiB


def test_nothing_is_made_before_the_first_use(make_rig: RigMaker) -> None:
    """Off CUDA no torch pools exist: every byte counts as live, close has nothing to do."""
    alloc = make_rig("cuda_like", capacity=16 * MiB).allocator
    with alloc.use_memory_pool("weights"):
        alloc.allocate(1 << 16)
    binding = alloc._torch  # the allocator's TorchBinding
    assert binding.current is None
    assert binding.live_ranges("weights") is None
    binding.close()
    alloc.close()


def test_the_pools_are_made_once_whichever_thread_asks_first(make_rig: RigMaker) -> None:
    """Threads asking at once get one TorchPools; the graph pool's ranges stay unknown (it is backed up whole)."""
    pytest.importorskip("torch")
    alloc = make_rig("cuda_like", capacity=16 * MiB).allocator
    binding = TorchBinding(table=alloc._table, driver=alloc.driver, book=alloc._book, graphs=alloc._graphs)
    made: list[object] = []
    start = threading.Barrier(4)

    def ask() -> None:
        start.wait()
        made.append(binding.pools())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 4 and all(p is made[0] for p in made) and binding.current is made[0]
    assert binding.live_ranges("cudagraph") is None and binding.live_ranges("weights") is None
    alloc.close()
