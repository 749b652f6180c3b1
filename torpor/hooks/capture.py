"""Capture routing: capture sites get the cuMem graph pool when it is active and their plain pool otherwise.

:func:`capture_pool` is the one context every capture site uses. When the
shared predicate says active it enters ``controller.capture(site)`` (guarded:
refused unless the engine is awake, recorded as ``graph_captured``) and yields
the cuMem graph pool; otherwise it yields the plain pool the site passed in.
Either way it first points NCCL's graph allocator at the pool it yields,
through the hook the integration registered with
:func:`set_nccl_graph_pool_hook` (torch has no public API for that, so the
default is a no-op). Memory profiling wraps its captures in
:func:`plain_capture`, a context variable, so they go to a throwaway plain pool
and are freed with their graphs, as without sleep mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from torpor.allocator.graphpool import call_graph_pool_hooks, exchange_graph_pool_hook, slot_graph_pool_hook
from torpor.errors import (
    CaptureRoutingError,
)
from torpor.hooks.predicate import CudagraphPoolDecision

if TYPE_CHECKING:
    from torpor.statemachine.controller import SleepController

#: Called with the pool a capture is about to use (an id, a handle, or None for a private pool).
NcclGraphPoolHook = Callable[[object], None]


_plain: ContextVar[bool] = ContextVar("torpor_plain_capture", default=False)

#: Register ``hook(pool)``, called before each routed capture; None empties the slot. Returns the previous hook.
#: vLLM's integration registers a function that calls its NCCL allocator's ``set_graph_pool_id``; a plain
#: PyTorch user needs none. The hook lives in the allocator's one registry (hooks hold no state): the
#: memory's ``capture_into_pool`` calls it for the cuMem pool, :func:`capture_pool` for a plain pool.
set_nccl_graph_pool_hook = exchange_graph_pool_hook

#: The registered NCCL graph-pool hook (None: none registered).
nccl_graph_pool_hook = slot_graph_pool_hook


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
        call_graph_pool_hooks(plain_pool)
        yield plain_pool
        return
    if controller is None:
        msg = (
            f"cannot route the capture at {site!r} into the cuMem graph pool: the pool is active "
            "but no SleepController was given (pass controller=..., or wrap profiling captures in plain_capture())"
        )
        raise CaptureRoutingError(msg)
    with controller.capture(site) as pool:  # the memory's capture_into_pool calls the hooks with its pool
        yield pool
