"""One generation of the CUDA-graph pool: its id, torch's MemPool, and the graphs captured into it by site.

A :class:`GraphPool` is one generation of an allocator's pool (tag
``cudagraph``): its id, torch's MemPool on CUDA, and the graphs captured into
it by site, each held by weak reference, so a holder disappears when the
caller drops its graph. The handle a capture gets and the allocator's capture
observers are :mod:`torpor.graphcapture`'s. There is no process-wide registry
here: the process-wide NCCL hook is the integration's
(``torpor.hooks.set_nccl_graph_pool_hook``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from torpor.graphcapture import PoolId


class GraphPool:
    """One generation of the graph pool: its id, the torch MemPool (None off CUDA), and its graphs."""

    def __init__(self, pool_id: PoolId, mempool: Any = None) -> None:
        self.id = pool_id
        self.mempool = mempool
        self._graphs: list[tuple[weakref.ref[Any] | None, str, Any]] = []
        self._lock = threading.Lock()

    def record(self, graph: object, site: str) -> None:
        """Hold ``graph`` weakly under ``site`` (a strong-unreferenceable object is held by id only)."""
        try:
            ref: weakref.ref[Any] | None = weakref.ref(graph)
        except TypeError:
            ref = None
        with self._lock:
            self._graphs.append((ref, site, None if ref is not None else graph))

    def live_graphs(self) -> list[str]:
        """Sites of the graphs still alive, in capture order."""
        with self._lock:
            self._graphs = [(r, s, o) for r, s, o in self._graphs if r is None or r() is not None]
            return [s for _, s, _ in self._graphs]

    def holders(self) -> list[str]:
        """Every holder: live graphs by site, then a count of other references to the pool."""
        graphs = self.live_graphs()
        out = [f"graph captured at {site}" for site in graphs]
        other = self.other_references(len(graphs))
        if other > 0:
            out.append(f"{other} other reference(s) to the pool (a capture or use_mem_pool without release)")
        return out

    def other_references(self, live: int) -> int:
        """References torch counts beyond the pool object itself and the live graphs we know of."""
        if self.mempool is None:
            return 0
        try:
            count = int(self.mempool.use_count())
        except Exception:  # an older torch without use_count: we only know our graphs
            return 0
        return max(count - 1 - live, 0)
