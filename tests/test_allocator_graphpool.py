"""Tests of the graph pool bookkeeping: capture observers, capture handles, holders."""

from __future__ import annotations

import gc

from torpor.allocator import CaptureHandle, CaptureObservers, GraphPool


class Graph:
    """A stand-in for a CUDAGraph (weak-referenceable)."""


def test_observers_are_called_and_a_failing_observer_is_contained() -> None:
    """Every observer gets the pool id; one raising does not stop the others; a removed one is not called."""
    seen: list[tuple[int, int]] = []

    def bad(_: tuple[int, int]) -> None:
        raise RuntimeError("boom")

    observers = CaptureObservers([bad])
    remove_seen = observers.add(seen.append)
    observers.add(seen.append)  # added twice: called once
    observers.notify((0, 7))
    observers.remove(bad)
    observers.notify((0, 8))
    remove_seen()
    observers.notify((0, 9))
    assert seen == [(0, 7), (0, 8)]


def test_handle_is_a_pool_id_tuple_that_records_graphs() -> None:
    """A CaptureHandle equals its pool id, prints a name, and track() records the graph under its site."""
    pool = GraphPool((3, 4))
    handle = CaptureHandle((3, 4), "batch=8", pool.record)
    assert handle == (3, 4) and handle.pool == (3, 4)
    assert str(handle) == "cudagraph-pool-3.4"
    g = Graph()
    handle.track(g)
    assert pool.holders() == ["graph captured at batch=8"]


def test_holders_disappear_with_their_graph() -> None:
    """A graph held only weakly stops being a holder once dropped."""
    pool = GraphPool((0, 1))
    g = Graph()
    pool.record(g, "s1")
    del g
    gc.collect()
    assert pool.holders() == []


class FakeMemPool:
    """use_count() like torch.cuda.MemPool."""

    def __init__(self, count: int) -> None:
        self.count = count

    def use_count(self) -> int:
        return self.count


def test_other_references_are_counted_from_use_count() -> None:
    """References beyond the pool itself and known graphs are reported as other references."""
    g = Graph()
    pool = GraphPool((0, 2), FakeMemPool(3))
    pool.record(g, "s")
    holders = pool.holders()
    assert holders[0] == "graph captured at s"
    assert holders[1].startswith("1 other reference")
