"""Tests of torpor.allocator.torchside.graphstate: the graph pool's generations, refusals while asleep or referenced, observers."""

from __future__ import annotations

import gc

import pytest

from torpor.allocator import AllocatorError, GraphPool, SimDriver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.tagbook import TagBook
from torpor.allocator.torchside.graphstate import GraphPoolState
from torpor.errors import PoolBusy
from torpor.testrig import GRANULE as G


class Graph:
    """A stand-in for a captured CUDAGraph (weak-referenceable)."""


def state(seen: list[tuple[int, int]] | None = None) -> tuple[NativeTable, GraphPoolState]:
    """A graph pool state over a native table on a small simulated device, and the table."""
    book = TagBook(NativeTable(SimDriver(64 * G, granularity=G), 0))
    return book.table, GraphPoolState(book, [seen.append] if seen is not None else [])


def test_one_pool_per_generation_and_observers_told_each_capture() -> None:
    """Captures share the current pool; observers get its id per capture; after a release a new generation starts."""
    seen: list[tuple[int, int]] = []
    _, graphs = state(seen)
    assert graphs.pool_id() is None and graphs.holders() == []
    first = graphs.start_capture(None)
    assert graphs.start_capture(None) is first and seen == [first.id, first.id]
    assert graphs.release(lambda pool: None, lambda address: None) == 0
    second = graphs.start_capture(None)
    assert second.id != first.id and second.id == (-1, 2)


def test_a_pool_made_by_torch_is_dropped_through_the_callback() -> None:
    """A pool with a MemPool (CUDA) goes through ``drop``; one without through ``free`` per allocation."""
    _, graphs = state()
    made = GraphPool((5, 6), mempool=object())
    assert graphs.start_capture(lambda: made) is made
    dropped: list[GraphPool] = []
    graphs.release(dropped.append, lambda address: None)
    assert dropped == [made] and graphs.current is None


def test_release_frees_the_allocations_and_is_refused_while_referenced_or_asleep() -> None:
    """A referenced pool is refused (holders named); a released tag refuses capture and release; else bytes come back."""
    table, graphs = state()
    pool = graphs.start_capture(None)
    table.alloc("cudagraph", 0, 2 * G)
    g = Graph()
    pool.record(g, "decode bs=8")
    with pytest.raises(PoolBusy, match="decode bs=8"):
        graphs.release(lambda p: None, table.free)
    del g
    gc.collect()
    table.freeze("cudagraph")
    table.unmap_range("cudagraph")
    table.mark_released("cudagraph")
    with pytest.raises(PoolBusy, match="asleep"):
        graphs.release(lambda p: None, table.free)
    with pytest.raises(AllocatorError, match="released"):
        graphs.start_capture(None)
    table.map_back("cudagraph")
    table.mark_awake("cudagraph")
    assert graphs.release(lambda p: None, table.free) == 2 * G
    assert table.usage("cudagraph").nbytes == 0


def test_detach_forgets_the_pool_without_freeing() -> None:
    """detach() (teardown) returns the pool and leaves its memory alone."""
    table, graphs = state()
    pool = graphs.start_capture(None)
    table.alloc("cudagraph", 0, G)
    assert graphs.detach() is pool and graphs.current is None
    assert table.usage("cudagraph").nbytes == G
