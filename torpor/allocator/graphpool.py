"""The process's CUDA-graph pool: its generations, the graphs captured into it by site, and the pool-id hook.

One pool per process (tag ``cudagraph``), created at the first capture. Each
capture is recorded with its site; the graph object is held by weak reference,
so a holder disappears when the caller drops its graph. The hook registered
with :func:`set_graph_pool_hook` is called with the pool id whenever a capture
starts (the integration points NCCL's graph allocator at it).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

logger = logging.getLogger("torpor.allocator")

PoolId = tuple[int, int]
_hooks: list[Callable[[Any], None]] = []
_slot: list[Callable[[Any], None] | None] = [None]
_hooks_lock = threading.Lock()


def set_graph_pool_hook(hook: Callable[[PoolId], None] | None) -> None:
    """Register ``hook(pool_id)``, called when a capture into the graph pool starts (None clears all hooks)."""
    with _hooks_lock:
        if hook is None:
            _hooks.clear()
            _slot[0] = None
        elif hook not in _hooks:
            _hooks.append(hook)


def remove_graph_pool_hook(hook: Callable[[PoolId], None]) -> None:
    """Unregister a hook added by :func:`set_graph_pool_hook`."""
    with _hooks_lock:
        if hook in _hooks:
            _hooks.remove(hook)


def exchange_graph_pool_hook(hook: Callable[[Any], None] | None) -> Callable[[Any], None] | None:
    """Put ``hook`` in the integration's one slot (replacing and returning the previous one; None empties it).

    The slot's hook is one of the registered hooks: it is called for every
    capture into the graph pool and, through ``torpor.hooks.capture_pool``,
    for captures into a plain pool too. ``torpor.hooks.set_nccl_graph_pool_hook``
    is this function.
    """
    with _hooks_lock:
        previous = _slot[0]
        if previous is not None and previous in _hooks:
            _hooks.remove(previous)
        _slot[0] = hook
        if hook is not None and hook not in _hooks:
            _hooks.append(hook)
    return previous


def slot_graph_pool_hook() -> Callable[[Any], None] | None:
    """The hook in the integration's slot (None when empty)."""
    return _slot[0]


def call_graph_pool_hooks(pool_id: object) -> None:
    """Call every registered hook with ``pool_id``; a failing hook is logged, never raised."""
    with _hooks_lock:
        hooks = list(_hooks)
    for hook in hooks:
        try:
            hook(pool_id)
        except Exception:  # a hook must not break a capture
            logger.exception("graph pool hook %r failed for pool %s", hook, pool_id)


class CaptureHandle(tuple[int, int]):
    """The pool id (pass it as ``torch.cuda.graph(pool=...)``), plus what records the captured graph.

    ``handle.pool`` is the plain id; ``handle.graph(g, **kw)`` is
    ``torch.cuda.graph(g, pool=handle.pool, **kw)`` that also records ``g``;
    ``handle.track(obj)`` records a graph captured some other way.
    """

    site: str
    _record: Callable[[object, str], None]

    def __new__(cls, pool_id: PoolId, site: str, record: Callable[[object, str], None]) -> CaptureHandle:
        self = super().__new__(cls, pool_id)
        self.site = site
        self._record = record
        return self

    @property
    def pool(self) -> PoolId:
        """The pool id as a plain tuple."""
        return (self[0], self[1])

    def track(self, graph: object) -> None:
        """Record ``graph`` (held weakly) as captured at this handle's site."""
        self._record(graph, self.site)

    def graph(self, cuda_graph: Any, **kwargs: Any) -> AbstractContextManager[Any]:
        """``torch.cuda.graph(cuda_graph, pool=self.pool, **kwargs)``, recording ``cuda_graph`` under the site."""
        import torch

        self.track(cuda_graph)
        return torch.cuda.graph(cuda_graph, pool=self.pool, **kwargs)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"cudagraph-pool-{self[0]}.{self[1]}"

    def __reduce__(self) -> Any:
        return (tuple, (self.pool,))


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


@contextmanager
def no_hooks() -> Iterator[None]:
    """Temporarily run without graph pool hooks (tests)."""
    with _hooks_lock:
        saved = list(_hooks)
        _hooks.clear()
    try:
        yield
    finally:
        with _hooks_lock:
            _hooks[:] = saved
