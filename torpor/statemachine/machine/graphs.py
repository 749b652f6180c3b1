"""The cudagraph pool's commands: capture a graph into the pool, release the pool once nothing references it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torpor.errors import PoolBusy, TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.protocol import GraphPoolMemory
from torpor.statemachine.machine.gate import CommandGate


class GraphPool(CommandGate):
    """``capture(site)`` and ``release_cudagraph_pool()`` over a :class:`GraphPoolMemory`."""

    @contextmanager
    def capture(self, site: str) -> Iterator[object]:
        """Capture one graph into the cudagraph pool; yields what ``torch.cuda.graph(pool=...)`` takes."""
        with self._command("capture", site=site):
            self._guard("capture")
            memory = self._graph_memory("capture")
            first = self.projection.pool is None
            start = time.perf_counter()
            with ExitStack() as stack:
                try:
                    pool = stack.enter_context(memory.capture_into_pool(site))
                except TorporError as exc:  # the pool could not be set up: nothing captured, say why
                    self._refuse("capture", exc)
                yield pool
            pool_name = str(pool)
            if first:
                self._emit(EventKind.POOL_CREATED, pool=pool_name)
            self._emit(
                EventKind.GRAPH_CAPTURED,
                site=site,
                pool=pool_name,
                seconds=time.perf_counter() - start,
                usage=self._resident_usage(),
            )

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool once nothing references it; return the bytes it held."""
        with self._command("release_pool"):
            memory = self._graph_memory("release_pool")
            self._guard("release_pool")  # asleep: PoolBusy, the pool is asleep with the engine
            holders = list(memory.cudagraph_pool_holders())
            if holders:
                reason = f"cudagraph pool is referenced by {len(holders)} holder(s) ({'; '.join(holders)}); release the graphs first"
                self._refuse("release_pool", PoolBusy(reason, holders))
            pool = self.projection.pool
            try:
                freed = memory.release_cudagraph_pool()
            except TorporError as exc:
                self._refuse("release_pool", exc)
            self._emit(EventKind.POOL_RELEASED, pool=pool, bytes=freed, usage=self._resident_usage())
            return freed

    def _graph_memory(self, command: str) -> GraphPoolMemory:
        if not isinstance(self.memory, GraphPoolMemory):
            msg = f"cannot {command}: {type(self.memory).__name__} has no cudagraph pool"
            self._refuse(command, TorporError(msg))
        return self.memory  # type: ignore[return-value]
