"""One generation of the CUDA-graph pool, the handle a capture gets, and an allocator's capture observers.

A :class:`GraphPool` is one generation of an allocator's pool (tag
``cudagraph``): its id, torch's MemPool on CUDA, and the graphs captured into
it by site, each held by weak reference, so a holder disappears when the
caller drops its graph. :class:`CaptureObservers` is the allocator's
notification point: it tells its subscribers the pool id whenever a capture
starts. There is no process-wide registry here: the process-wide NCCL hook is
the integration's (``torpor.hooks.set_nccl_graph_pool_hook``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

logger = logging.getLogger("torpor.allocator")

PoolId = tuple[int, int]
#: Called with the pool id when a capture into an allocator's graph pool starts.
CaptureObserver = Callable[[PoolId], None]


class CaptureObservers:
    """One allocator's notification point: the callables told the pool id whenever a capture into its graph pool starts.

    Per allocator, not per process: an integration that must follow the pool
    (NCCL's graph allocator) subscribes to the allocator it uses, or calls its
    own hooks around the capture (``torpor.hooks.capture_pool`` does). A
    failing observer is logged and never breaks the capture.
    """

    _logger: ClassVar[logging.Logger] = logger

    def __init__(self, observers: Iterable[CaptureObserver] = ()) -> None:
        self._lock = threading.Lock()
        self._observers: list[CaptureObserver] = []
        for observer in observers:
            self.add(observer)

    def add(self, observer: CaptureObserver) -> Callable[[], None]:
        """Tell ``observer(pool_id)`` of every capture from now on (once, however often added); returns its remover."""
        with self._lock:
            if observer not in self._observers:
                self._observers.append(observer)
        return lambda: self.remove(observer)

    def remove(self, observer: CaptureObserver) -> None:
        """Stop telling ``observer`` (nothing when it is not subscribed)."""
        with self._lock:
            if observer in self._observers:
                self._observers.remove(observer)

    def notify(self, pool_id: PoolId) -> None:
        """Call every observer with ``pool_id`` in subscription order; a failing one is logged, never raised."""
        with self._lock:
            observers = self._called()
        for observer in observers:
            try:
                observer(pool_id)
            except Exception:  # an observer must not break a capture
                self._logger.exception("graph pool observer %r failed for pool %s", observer, pool_id)

    def _called(self) -> Sequence[CaptureObserver]:
        """The callables :meth:`notify` calls, in order (under the lock)."""
        return list(self._observers)


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
