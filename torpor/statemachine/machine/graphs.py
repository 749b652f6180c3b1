"""The cudagraph pool's steps: capture a graph into the pool, release the pool once nothing references it.

Both need a memory with ``Capability.GRAPH_POOL``
(:class:`~torpor.statemachine.core.protocol.GraphPoolMemory`); any other is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torpor.errors import PoolBusy, TorporError
from torpor.statemachine.core.events import GraphCaptured, PoolCreated, PoolReleased
from torpor.statemachine.core.protocol import GraphPoolMemory
from torpor.statemachine.machine.context import Context


def _graph_memory(ctx: Context, command: str) -> GraphPoolMemory:
    memory = ctx.abilities.graphs
    if memory is None:
        msg = f"cannot {command}: {type(ctx.memory).__name__} has no cudagraph pool"
        ctx.gate.refuse(command, TorporError(msg))
    return memory


@contextmanager
def capture(ctx: Context, site: str) -> Iterator[object]:
    """Inside the gate: capture one graph at ``site`` into the pool; yields what ``torch.cuda.graph(pool=...)`` takes."""
    ctx.gate.guard("capture")
    memory = _graph_memory(ctx, "capture")
    first = ctx.projection.pool is None
    start = time.perf_counter()
    with ExitStack() as stack:
        try:
            pool = stack.enter_context(memory.capture_into_pool(site))
        except TorporError as exc:  # the pool could not be set up: nothing captured, say why
            ctx.gate.refuse("capture", exc)
        yield pool
    pool_name = str(pool)
    if first:
        ctx.recorder.record(PoolCreated(pool=pool_name))
    ctx.recorder.record(
        GraphCaptured(site=site, pool=pool_name, seconds=time.perf_counter() - start, usage=ctx.resident_usage())
    )


def release_pool(ctx: Context) -> int:
    """Inside the gate: drop the graph pool once nothing references it; return the bytes it held."""
    memory = _graph_memory(ctx, "release_pool")
    ctx.gate.guard("release_pool")  # asleep: PoolBusy, the pool is asleep with the engine
    holders = list(memory.cudagraph_pool_holders())
    if holders:
        reason = (
            f"cudagraph pool is referenced by {len(holders)} holder(s) ({'; '.join(holders)}); release the graphs first"
        )
        ctx.gate.refuse("release_pool", PoolBusy(reason, holders))
    pool = ctx.projection.pool
    try:
        freed = memory.release_cudagraph_pool()
    except TorporError as exc:
        ctx.gate.refuse("release_pool", exc)
    ctx.recorder.record(PoolReleased(pool=pool, bytes=freed, usage=ctx.resident_usage()))
    return freed
