"""Where this thread's allocations go: a tag's ``use_memory_pool`` block, or the graph pool while a capture runs.

:class:`PoolRouting` is a part :class:`~torpor.allocator.TaggedAllocator` owns; the
allocator's ``use_memory_pool``, ``use_cudagraph_pool`` and ``capture_into_pool`` are
its blocks. A block pushes its tag on the book's stack for this thread (the raw path's
:meth:`~torpor.allocator.TaggedAllocator.allocate` reads it) and, on CUDA, enters the
tag's torch pool (torch's allocations go to the native library without Python).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from torpor.allocator.host.offload import HostArena
from torpor.allocator.sleepwake.tagbook import TagBook
from torpor.allocator.torchside.binding import TorchBinding
from torpor.allocator.torchside.graphstate import GraphPoolState
from torpor.errors import AllocatorError
from torpor.graphcapture import CaptureHandle, PoolId
from torpor.statemachine.core.policy import CUDAGRAPH

__all__ = ["PoolRouting"]


class PoolRouting:
    """The allocator's pool blocks over its book, host arena, torch side and graph-pool state.

    ``on_cuda``: torch's pools exist (CUDA's driver); ``grow_host``: pin ahead for the
    tagged bytes; ``pending_errors``: the errors of torch's malloc and free since last asked.
    """

    def __init__(
        self,
        *,
        book: TagBook,
        host: HostArena,
        torch: TorchBinding,
        graphs: GraphPoolState,
        on_cuda: bool,
        grow_host: Callable[[], None],
        pending_errors: Callable[[], list[AllocatorError]],
    ) -> None:
        self._book = book
        self._host = host
        self._torch = torch
        self._graphs = graphs
        self._on_cuda = on_cuda
        self._grow_host = grow_host
        self._pending_errors = pending_errors

    @contextmanager
    def memory_pool(self, tag: str) -> Iterator[None]:
        """This thread's allocations go to ``tag`` inside (``TaggedAllocator.use_memory_pool``)."""
        self._book.state(tag)
        self._book.enter_block(tag)
        try:
            with self._book.routed(tag):
                torch_ctx = self._torch.pools().use(tag) if self._on_cuda else None
                try:
                    if torch_ctx is None:
                        yield
                    else:
                        with torch_ctx:
                            yield
                except Exception as exc:
                    pending = self._pending_errors()
                    if pending:
                        raise pending[-1] from exc
                    raise
                finally:
                    if tag not in self._host.policy.prepin_exclude:
                        self._grow_host()  # torch's allocations in the block never call Python: pin ahead for them now
        finally:
            self._book.leave_block(tag)

    def empty_cache(self, tags: Sequence[str] | None) -> int:
        """Give back the free cached segments of ``tags`` (None: all) no open block uses (``TaggedAllocator.empty_cache``)."""
        pools = self._torch.current  # None before the first use on CUDA: no cache
        if pools is None:
            return 0
        return pools.empty_cache(None if tags is None else list(tags))

    @contextmanager
    def cudagraph_pool(self) -> Iterator[PoolId]:
        """The graph pool's id; allocations inside are tagged cudagraph (``TaggedAllocator.use_cudagraph_pool``)."""
        make = (lambda: self._torch.pools().new_graph_pool()) if self._on_cuda else None
        pool = self._graphs.start_capture(make)
        with self._book.routed(CUDAGRAPH):
            self._host.pause()  # no pinning while a graph is captured
            try:
                yield pool.id
            finally:
                self._host.resume()

    @contextmanager
    def capture(self, site: str) -> Iterator[CaptureHandle]:
        """A capture at ``site`` into the graph pool (``TaggedAllocator.capture_into_pool``)."""
        with self.cudagraph_pool() as pool_id:
            pool = self._graphs.current
            if pool is None:  # released by another thread mid-capture
                msg = f"the cudagraph pool was released while capturing at {site!r}"
                raise AllocatorError("capture", CUDAGRAPH, msg)
            yield CaptureHandle(pool_id, site, pool.record)
