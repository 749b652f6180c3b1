"""Tests of the graph pool bookkeeping: the holders of one generation of the pool."""

from __future__ import annotations

import gc

from torpor.allocator import GraphPool


class Graph:
    """A stand-in for a CUDAGraph (weak-referenceable)."""


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
