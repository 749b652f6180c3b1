"""Capture routing: capture sites get the cuMem graph pool when it is active and their plain pool otherwise.

:func:`capture_pool` is the one context every capture site uses. When the
shared predicate says active it enters ``controller.capture(site)`` (guarded:
refused unless the engine is awake, recorded as ``graph_captured``) and yields
the cuMem graph pool; otherwise it yields the plain pool the site passed in.
Either way it first points NCCL's graph allocator at the pool it yields,
through the hook the integration registered with
:func:`set_nccl_graph_pool_hook` (torch has no public API for that, so the
default is a no-op). That registry (:class:`GraphPoolHooks`) lives here, in
the integration that needs it; the allocator only tells its own observers. Memory profiling wraps its captures in
:func:`plain_capture`, a context variable, so they go to a throwaway plain pool
and are freed with their graphs, as without sleep mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from torpor.errors import (
    CaptureRoutingError,
)
from torpor.graphcapture import CaptureHandle, CaptureObserver, CaptureObservers
from torpor.hooks.predicate import CudagraphPoolDecision

if TYPE_CHECKING:
    from torpor.statemachine.machine.controller import SleepController

logger = logging.getLogger("torpor.hooks")

#: Called with the pool a capture is about to use (an id, a handle, or None for a private pool).
NcclGraphPoolHook = Callable[[object], None]


_plain: ContextVar[bool] = ContextVar("torpor_plain_capture", default=False)


class GraphPoolHooks(CaptureObservers):
    """The integration's graph-pool hooks: one NCCL slot plus further hooks, called before every routed capture.

    Process-wide, as NCCL's graph allocator is: :func:`capture_pool` (and the
    vLLM backend's ``cudagraph_pool``) call them with the pool the capture is
    about to use, the cuMem pool's id or the plain pool. The allocator holds no
    hook of its own beyond its per-instance observers
    (``TaggedAllocator.on_capture``); this is the same notification point with
    the NCCL slot called last. A hook that raises is logged and never breaks a
    capture.
    """

    _logger = logger

    def __init__(self) -> None:
        super().__init__()
        self._slot: NcclGraphPoolHook | None = None

    def exchange(self, hook: NcclGraphPoolHook | None) -> NcclGraphPoolHook | None:
        """Put ``hook`` in the NCCL slot (None empties it); return the hook it replaces."""
        with self._lock:
            previous, self._slot = self._slot, hook
        return previous

    def slot(self) -> NcclGraphPoolHook | None:
        """The hook in the NCCL slot (None when empty)."""
        return self._slot

    def call(self, pool: object) -> None:
        """Call the further hooks (:meth:`add`), then the slot's, with ``pool``; a failing hook is logged, never raised."""
        self.notify(pool)  # type: ignore[arg-type]  # a hook takes any pool, not only an allocator's id

    def _called(self) -> Sequence[CaptureObserver]:
        return [*self._observers, *([self._slot] if self._slot is not None else [])]


#: The process's one registry (the integration's, not the allocator's).
GRAPH_POOL_HOOKS = GraphPoolHooks()

#: Register ``hook(pool)``, called before each routed capture; None empties the slot. Returns the previous hook.
#: vLLM's integration registers a function that calls its NCCL allocator's ``set_graph_pool_id``; a plain
#: PyTorch user needs none. It is called with the cuMem pool's id (a plain tuple) or the plain pool.
set_nccl_graph_pool_hook = GRAPH_POOL_HOOKS.exchange

#: The registered NCCL graph-pool hook (None: none registered).
nccl_graph_pool_hook = GRAPH_POOL_HOOKS.slot

#: Call ``hook(pool)`` before every routed capture as well as the NCCL slot's; returns its remover.
add_graph_pool_hook = GRAPH_POOL_HOOKS.add

#: Stop calling a hook added with :func:`add_graph_pool_hook`.
remove_graph_pool_hook = GRAPH_POOL_HOOKS.remove


def pool_id_of(pool: object) -> object:
    """What the hooks are told of a pool: a :class:`CaptureHandle`'s plain id, anything else as it is."""
    return pool.pool if isinstance(pool, CaptureHandle) else pool


@contextmanager
def cumem_capture(controller: SleepController, site: str) -> Iterator[object]:
    """``controller.capture(site)``, the graph-pool hooks told the pool first: yields what ``torch.cuda.graph(pool=...)`` takes."""
    with controller.capture(site) as pool:
        GRAPH_POOL_HOOKS.call(pool_id_of(pool))
        yield pool


@contextmanager
def plain_capture() -> Iterator[None]:
    """Inside this block, :func:`capture_pool` yields the plain pool even when the cuMem pool is active.

    For memory profiling: graphs captured to measure memory must land in a
    throwaway pool that is freed with them. Scoped to the current thread or
    asyncio task (a ``ContextVar``) and nestable.
    """
    token = _plain.set(True)
    try:
        yield
    finally:
        _plain.reset(token)


def in_plain_capture() -> bool:
    """True inside :func:`plain_capture` in this thread or task."""
    return _plain.get()


def routes_to_cumem(decision: CudagraphPoolDecision) -> bool:
    """True when a capture here would go to the cuMem graph pool."""
    return decision.active and not _plain.get()


@contextmanager
def capture_pool(
    decision: CudagraphPoolDecision,
    site: str,
    *,
    controller: SleepController | None = None,
    plain_pool: object = None,
) -> Iterator[object]:
    """Yield the pool for one capture at ``site``: the cuMem graph pool when active, else ``plain_pool``.

    Use it as ``with capture_pool(d, "decode bs=8", controller=c, plain_pool=h) as pool:
    with torch.cuda.graph(g, pool=pool): ...``. NCCL's graph allocator is
    pointed at the yielded pool first (see :func:`set_nccl_graph_pool_hook`).
    A capture into the cuMem pool goes through ``controller.capture(site)``,
    so it is refused unless the engine is awake and is recorded as an event.
    """
    if not routes_to_cumem(decision):
        GRAPH_POOL_HOOKS.call(plain_pool)
        yield plain_pool
        return
    if controller is None:
        msg = (
            f"cannot route the capture at {site!r} into the cuMem graph pool: the pool is active "
            "but no SleepController was given (pass controller=..., or wrap profiling captures in plain_capture())"
        )
        raise CaptureRoutingError(msg)
    with cumem_capture(controller, site) as pool:
        yield pool
