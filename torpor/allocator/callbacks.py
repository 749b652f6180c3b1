"""The torch side: ctypes allocation callbacks for ``torch._C._cuda_customAllocator`` and a ``MemPool`` per tag.

No compiled extension: each tag gets a pair of ctypes callbacks that call
:meth:`TaggedAllocator.allocate` / :meth:`TaggedAllocator.free`, wrapped by torch
as a pluggable allocator, and a ``torch.cuda.MemPool`` built on it. Rules at the
C boundary: nothing raises through it (errors are logged, the allocation returns
NULL, and the error is kept for the caller, see
:meth:`TaggedAllocator.pending_errors`); a thread with no current context gets
the device's primary context; callbacks live as long as the process (torch may
call them at interpreter exit).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torpor.allocator.errors import wrap
from torpor.allocator.graphpool import GraphPool

if TYPE_CHECKING:
    from torpor.allocator.tagged import TaggedAllocator

logger = logging.getLogger("torpor.allocator")

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_KEEP_ALIVE: list[object] = []  # callbacks and their torch allocators: never collected


def _make_callbacks(allocator: TaggedAllocator, tag: str) -> tuple[Any, Any]:
    def alloc(size: int, device: int, stream: int) -> int:
        try:
            allocator.driver.ensure_context(device)
            return allocator.allocate(size, tag, device)
        except BaseException as exc:  # never across the C boundary
            error = wrap("allocate", tag, exc)
            allocator._record_callback_error(error)
            logger.error("torpor allocation of %d bytes in tag %r on device %d failed: %s", size, tag, device, error)
            return 0

    def free(ptr: int | None, size: int, device: int, stream: int) -> None:
        if not ptr:
            return
        try:
            allocator.driver.ensure_context(device)
            allocator.free(ptr)
        except BaseException as exc:  # never across the C boundary
            error = wrap("free", tag, exc)
            allocator._record_callback_error(error)
            logger.error("torpor free of %#x (%d bytes, tag %r) failed: %s", ptr, size, tag, error)

    return _ALLOC(alloc), _FREE(free)


class TorchPools:
    """One pluggable allocator and MemPool per tag, plus the generations of the graph pool."""

    def __init__(self, allocator: TaggedAllocator) -> None:
        from torpor.extras import require

        require("torch", "TaggedAllocator's CUDA memory pools (use_memory_pool, capture)")
        self.allocator = allocator
        self._allocators: dict[str, Any] = {}
        self._pools: dict[str, Any] = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        atexit.register(self.close)  # pools must go while the interpreter can still run the free callback

    def torch_allocator(self, tag: str) -> Any:
        """The ``_cuda_CUDAAllocator`` whose callbacks allocate under ``tag`` (made once per tag)."""
        import torch

        with self._lock:
            found = self._allocators.get(tag)
            if found is None:
                alloc_cb, free_cb = _make_callbacks(self.allocator, tag)
                alloc_ptr = int(ctypes.cast(alloc_cb, ctypes.c_void_p).value or 0)
                free_ptr = int(ctypes.cast(free_cb, ctypes.c_void_p).value or 0)
                found = torch._C._cuda_customAllocator(alloc_ptr, free_ptr)
                _KEEP_ALIVE.extend((alloc_cb, free_cb, found))
                self._allocators[tag] = found
            return found

    def pool(self, tag: str) -> Any:
        """The MemPool of ``tag`` (created on first use, kept for the process)."""
        import torch

        found = self._pools.get(tag)
        if found is None:
            found = torch.cuda.MemPool(self.torch_allocator(tag))
            self._pools[tag] = found
        return found

    @contextmanager
    def use(self, tag: str) -> Iterator[None]:
        """Route this thread's torch allocations to ``tag``'s pool; an inner tag wins over an outer one."""
        import torch

        stack: list[list[Any]] = self._local.__dict__.setdefault("stack", [])
        pool = self.pool(tag)
        if stack:  # torch serves the first matching pool: step out of the outer one while inside
            stack[-1][1].__exit__(None, None, None)
        ctx = torch.cuda.use_mem_pool(pool)
        ctx.__enter__()
        entry = [pool, ctx]
        stack.append(entry)
        try:
            yield
        finally:
            stack.pop()
            entry[1].__exit__(None, None, None)
            if stack:
                outer = torch.cuda.use_mem_pool(stack[-1][0])
                outer.__enter__()
                stack[-1][1] = outer

    def new_graph_pool(self) -> GraphPool:
        """A fresh MemPool for the graph pool (tag cudagraph) wrapped as a :class:`GraphPool`."""
        import torch

        mempool = torch.cuda.MemPool(self.torch_allocator("cudagraph"))
        return GraphPool(mempool.id, mempool)

    def drop(self, pool: GraphPool) -> None:
        """Let torch free the pool's segments (through the free callback) by dropping the last reference."""
        import torch

        mempool = pool.mempool
        pool.mempool = None
        torch.cuda.synchronize()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:  # cuBLAS keeps a workspace per capture stream, allocated in the pool
            clear()
        del mempool
        gc.collect()

    def close(self) -> None:
        """Drop every tag's MemPool so torch returns their cached segments (teardown)."""
        import torch

        if self._pools:
            torch.cuda.synchronize()
            self._pools.clear()
            gc.collect()
        graph = self.allocator._graph_pool
        if graph is not None and graph.mempool is not None:
            self.allocator._graph_pool = None
            self.drop(graph)
