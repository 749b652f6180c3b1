"""The torch side of one allocator, bound at the first use on CUDA: nothing imports torch before.

:class:`TorchBinding` makes the allocator's :class:`~torpor.allocator.torchside.pools.TorchPools`
(one pluggable allocator per tag, pools for its blocks) when a ``use_memory_pool`` block
or a capture first needs them on CUDA, and answers for them until then: no
live ranges (every byte of an allocation counts as live), nothing to trim and
nothing to close. It is the torch side the sleep/wake cycle is given
(:class:`~torpor.allocator.sleepwake.cycle.TorchSide`: live ranges, trimming
before a sleep).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.tagbook import TagBook
from torpor.allocator.torchside.graphstate import GraphPoolState
from torpor.allocator.torchside.pools import TorchPools
from torpor.errors import AllocatorError
from torpor.statemachine.core.policy import CUDAGRAPH


class _Parts(NamedTuple):
    """The allocator's parts the torch pools work on (they meet :class:`~torpor.allocator.torchside.pools.AllocatorParts`)."""

    table: NativeTable
    driver: Driver
    book: TagBook
    graphs: GraphPoolState


class TorchBinding:
    """An allocator's :class:`TorchPools`, made at the first use (raises ``MissingExtra`` then without torch).

    Handed the allocator's table, driver, tag book and graph-pool state, by keyword.
    """

    def __init__(self, *, table: NativeTable, driver: Driver, book: TagBook, graphs: GraphPoolState) -> None:
        self._allocator = _Parts(table=table, driver=driver, book=book, graphs=graphs)
        self._lock = threading.Lock()
        self._pools: TorchPools | None = None

    @property
    def current(self) -> TorchPools | None:
        """The torch pools, None before the first use."""
        return self._pools

    def pools(self) -> TorchPools:
        """The torch pools, made now on the first use (from any thread, once); refused once the allocator is closed."""
        if self._allocator.table.closed:  # its slots may serve another allocator by now (NativeTable.slot)
            raise AllocatorError("use_memory_pool", None, "the allocator is closed: torch gets no pool of it")
        pools = self._pools
        if pools is None:
            with self._lock:
                pools = self._pools
                if pools is None:
                    pools = self._pools = TorchPools(self._allocator)
        return pools

    def live_ranges(self, tag: str) -> dict[int, list[tuple[int, int]]] | None:
        """Segment -> its blocks in use, where torch has a pool of ``tag`` (None: every byte counts as live).

        The graph pool is backed up whole: blocks a capture freed are still the graphs' working memory.
        """
        pools = self._pools
        if pools is None or tag == CUDAGRAPH:
            return None
        found: dict[int, list[tuple[int, int]]] | None = pools.live_ranges(tag)
        return found

    def trim_free(self, tags: Sequence[str], synced: bool) -> None:
        """Give back the free segments of the tags' idle pools (nothing before the first use): before a sleep, before a wake.

        ``synced``: the tags' devices were synchronized just before; else they are synchronized
        first, as a kernel queued before a free may still touch a free segment (Invariant:
        stream-ordered trim, docs/architecture.md).
        """
        pools = self._pools
        if pools is None:
            return
        if not synced:
            table, driver = self._allocator.table, self._allocator.driver
            for device in {d for t in tags for _, _, d in table.allocations(t)}:
                driver.synchronize(device)
        pools.trim(list(tags), settled=True)

    def close(self) -> None:
        """Close the torch pools if they were made (torch frees their cached segments through the native free)."""
        if self._pools is not None:
            self._pools.close()
