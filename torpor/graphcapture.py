"""The capture vocabulary the allocator and capture routing share: a pool id, the handle a capture gets, the observers told of it.

:data:`PoolId` is a graph pool's id as torch takes it (``torch.cuda.graph(pool=...)``).
:class:`CaptureHandle` is what a capture into an allocator's graph pool yields:
the pool id, plus what records the captured graph under its site.
:class:`CaptureObservers` is a notification point: the callables
(:data:`CaptureObserver`) told the pool id whenever a capture starts. The
allocator holds one per instance (``TaggedAllocator.on_capture``); the hooks'
process-wide registry (``torpor.hooks.capture.GraphPoolHooks``) is one with an
NCCL slot. Neither owns these names, so neither imports the other for them.
torch is imported only inside :meth:`CaptureHandle.graph`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

#: The allocator's logger: a failing observer of an allocator's captures is logged there.
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
