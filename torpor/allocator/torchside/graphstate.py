"""The allocator's CUDA-graph pool over its generations: made at the first capture, dropped once nothing references it.

One pool per allocator (tag ``cudagraph``). :class:`GraphPoolState` holds the
current :class:`~torpor.allocator.torchside.graphpool.GraphPool` (None before the first
capture and after a release), counts its generations, refuses a capture or a
release while the tag is asleep, and tells the allocator's
:class:`~torpor.graphcapture.CaptureObservers` when a capture starts.
It is handed what differs between devices (how a pool is made on CUDA, how
its memory goes) by the allocator, so it imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from torpor.allocator.native import library as native
from torpor.allocator.sleepwake.tagbook import TagBook
from torpor.allocator.torchside.graphpool import GraphPool
from torpor.errors import AllocatorError, PoolBusy
from torpor.graphcapture import CaptureObserver, CaptureObservers, PoolId
from torpor.statemachine.core.policy import CUDAGRAPH

logger = logging.getLogger("torpor.allocator")


class GraphPoolState:
    """The current graph pool of one allocator, its generation count and its capture observers."""

    def __init__(self, book: TagBook, observers: Iterable[CaptureObserver] = ()) -> None:
        self._book = book
        self._pool: GraphPool | None = None
        self._generation = 0
        self.observers = CaptureObservers(observers)

    @property
    def current(self) -> GraphPool | None:
        """The current pool (None before the first capture or after a release)."""
        return self._pool

    def pool_id(self) -> PoolId | None:
        """The current pool's id, None when there is none."""
        pool = self._pool
        return pool.id if pool is not None else None

    def holders(self) -> list[str]:
        """Everything that still references the current pool (empty when it can be released)."""
        pool = self._pool
        return pool.holders() if pool is not None else []

    def start_capture(self, make: Callable[[], GraphPool] | None) -> GraphPool:
        """The pool a capture goes into (made by ``make`` on CUDA, else a simulated one), observers told its id.

        Refused (:class:`AllocatorError`) while the ``cudagraph`` tag is released.
        """
        with self._book.lock:
            self._book.state(CUDAGRAPH)
            state, nbytes, _ = self._book.table.usage(CUDAGRAPH)
            if state == native.RELEASED:
                msg = f"cannot capture: the cudagraph pool is released (asleep, {nbytes} bytes on host); wake first"
                raise AllocatorError("capture", CUDAGRAPH, msg)
            if self._pool is None:
                self._generation += 1
                self._pool = make() if make is not None else GraphPool((-1, self._generation))
            pool = self._pool
        self.observers.notify(pool.id)
        return pool

    def release(self, drop: Callable[[GraphPool], None], free: Callable[[int], None]) -> int:
        """Drop the pool once nothing references it; return the bytes it held; the next capture starts a new generation.

        ``drop`` lets torch free a pool it made (through the native free);
        ``free`` frees one allocation of a pool made without torch. Refused
        (:class:`PoolBusy`) while the tag is asleep or the pool is referenced.
        """
        table = self._book.table
        with self._book.lock:
            pool = self._pool
            if pool is None:
                return 0
            known = CUDAGRAPH in self._book
            state, before, _ = table.usage(CUDAGRAPH) if known else (0, 0, 0)
            if state == native.RELEASED:
                msg = (
                    f"cudagraph pool {pool.id} is asleep ({before} bytes released): "
                    "freeing it would unmap a second time; wake first"
                )
                raise PoolBusy(msg)
            holders = pool.holders()
            if holders:
                msg = f"cudagraph pool is referenced by {len(holders)} holder(s) ({'; '.join(holders)}); release the graphs first"
                raise PoolBusy(msg, holders)
            self._pool = None
            if pool.mempool is not None:
                drop(pool)  # torch frees the segments through the native free
                left = table.usage(CUDAGRAPH).nbytes
                if left:
                    logger.warning(
                        "%d bytes of the released graph pool are still allocated (tensors of it alive)", left
                    )
            elif known:
                for address, _, _ in table.allocations(CUDAGRAPH):
                    free(address)
            after = table.usage(CUDAGRAPH).nbytes if known else 0
            return before - after

    def detach(self) -> GraphPool | None:
        """Forget the current pool without freeing anything (teardown, also at interpreter exit: takes no lock); return it."""
        pool, self._pool = self._pool, None
        return pool
