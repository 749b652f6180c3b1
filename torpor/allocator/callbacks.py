"""The torch side: the native library's malloc/free pairs given to ``torch._C._cuda_customAllocator``, a ``MemPool`` per tag.

Each tag gets one slot of the library (:meth:`NativeTable.slot`): a plain C
malloc/free pair bound to the allocator's table and the tag, so torch's
allocation calls take neither the GIL nor any Python lock, whichever thread
makes them (frees route by slot, not by thread). Nothing raises across the C
boundary: a failed malloc returns NULL (torch raises its out-of-memory error)
and the library keeps the reason, which :meth:`TaggedAllocator.pending_errors`
returns and ``use_memory_pool`` raises. Slots live as long as the process (torch
may call them at interpreter exit; after ``close`` the library ignores them).
"""

from __future__ import annotations

import atexit
import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torpor.allocator.graphpool import GraphPool

if TYPE_CHECKING:
    from torpor.allocator.tagged import TaggedAllocator

_KEEP_ALIVE: list[object] = []  # torch allocators made on native slots: never collected


def segments(mempool: Any) -> list[dict[str, Any]]:
    """Torch's snapshot of one pool: its segments, each with its blocks (without traces where torch allows)."""
    try:
        found = mempool.snapshot(include_traces=False)
    except TypeError:  # torch before include_traces
        found = mempool.snapshot()
    return list(found)


def live_blocks(segment: dict[str, Any]) -> list[tuple[int, int]]:
    """(address, size) of the blocks of a segment that are not free ("inactive"), adjacent ones merged."""
    out: list[tuple[int, int]] = []
    pos = int(segment["address"])
    for block in segment.get("blocks", []):
        size = int(block["size"])
        start = int(block.get("address", pos))
        if block.get("state") != "inactive":
            if out and out[-1][0] + out[-1][1] == start:
                out[-1] = (out[-1][0], out[-1][1] + size)
            else:
                out.append((start, size))
        pos = start + size
    return out


class TorchPools:
    """One pluggable allocator per tag; a fresh MemPool per ``use_memory_pool`` block; the graph pool's generations.

    A block's pool is never allocated from once the block ends, so its free
    segments can go back: :meth:`trim` unmaps the segments torch holds entirely
    free in pools no block uses (the library keeps their records until torch
    frees them), and drops a pool once none of its blocks is allocated (torch
    then frees its segments through the native free).
    """

    def __init__(self, allocator: TaggedAllocator) -> None:
        self.allocator = allocator
        self._allocators: dict[str, Any] = {}
        self._pools: dict[str, list[list[Any]]] = {}  # tag -> [[MemPool, blocks using it], ...]
        self._local = threading.local()
        self._devices: set[int] = set()
        self._lock = threading.RLock()
        atexit.register(self.close)  # pools go while the library's context is alive (torch frees into it)

    def torch_allocator(self, tag: str) -> Any:
        """The ``_cuda_CUDAAllocator`` whose malloc/free allocate under ``tag`` (made once per tag)."""
        import torch

        with self._lock:
            found = self._allocators.get(tag)
            if found is None:
                self.allocator.tag_state(tag)
                malloc_ptr, free_ptr = self.allocator.table.slot(tag)
                found = torch._C._cuda_customAllocator(malloc_ptr, free_ptr)
                _KEEP_ALIVE.append(found)
                self._allocators[tag] = found
            return found

    def _new_pool(self, tag: str) -> list[Any]:
        import torch

        with self._lock:  # safe to hold across torch: the native malloc/free never take it
            entry = [torch.cuda.MemPool(self.torch_allocator(tag)), 1]
            self._pools.setdefault(tag, []).append(entry)
            return entry

    def _done(self, entry: list[Any]) -> None:
        with self._lock:
            entry[1] -= 1

    @contextmanager
    def use(self, tag: str) -> Iterator[None]:
        """Route this thread's torch allocations to a fresh pool of ``tag``; an inner tag wins over an outer one.

        Entering trims the tag's older pools; leaving trims this block's pool.
        """
        import torch

        stack: list[list[Any]] = self._local.__dict__.setdefault("stack", [])
        device = torch.cuda.current_device()
        if device not in self._devices:  # the copy/pinning side: this device's context and copy stream, made now
            self.allocator.driver.prepare_device(device)
            self._devices.add(device)
        self.trim([tag])
        entry = self._new_pool(tag)
        pool = entry[0]
        if stack:  # torch serves the first matching pool: step out of the outer one while inside
            stack[-1][1].__exit__(None, None, None)
        ctx = torch.cuda.use_mem_pool(pool)
        ctx.__enter__()
        frame = [pool, ctx]
        stack.append(frame)
        try:
            yield
        finally:
            stack.pop()
            frame[1].__exit__(None, None, None)
            if stack:
                outer = torch.cuda.use_mem_pool(stack[-1][0])
                outer.__enter__()
                stack[-1][1] = outer
            self._done(entry)
            self.trim([tag])

    def trim(self, tags: list[str] | None = None) -> None:
        """Return the free segments of pools no block uses (of ``tags``, or all), and drop pools left empty."""
        dropped = False
        with self._lock:
            for tag in list(self._pools) if tags is None else tags:
                keep = []
                for entry in self._pools.get(tag, []):
                    if entry[1] > 0:  # a block allocates from it
                        keep.append(entry)
                        continue
                    segs = segments(entry[0])
                    for seg in segs:
                        if int(seg.get("allocated_size", 0)) == 0:
                            self.allocator.table.trim(int(seg["address"]))
                    if any(int(seg.get("allocated_size", 0)) for seg in segs):
                        keep.append(entry)
                    else:
                        dropped = True  # torch frees its segments through the native free when it goes
                if tag in self._pools:
                    self._pools[tag] = keep
        if dropped:
            gc.collect(0)

    def live_ranges(self, tag: str) -> dict[int, list[tuple[int, int]]] | None:
        """Segment address -> its blocks in use, over every pool of ``tag`` (None when torch never allocated in it)."""
        with self._lock:
            entries = list(self._pools.get(tag, []))
        if not entries:
            return None
        return {int(seg["address"]): live_blocks(seg) for entry in entries for seg in segments(entry[0])}

    def new_graph_pool(self) -> GraphPool:
        """A fresh MemPool for the graph pool (tag cudagraph) wrapped as a :class:`GraphPool`."""
        import torch

        mempool = torch.cuda.MemPool(self.torch_allocator("cudagraph"))
        return GraphPool(mempool.id, mempool)

    def drop(self, pool: GraphPool) -> None:
        """Let torch free the pool's segments (through the native free) by dropping the last reference."""
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
        """Drop every tag's pools so torch returns their cached segments (teardown)."""
        import torch

        if self._pools:
            torch.cuda.synchronize()
            self._pools.clear()
            gc.collect()
        graph = self.allocator._graph_pool
        if graph is not None and graph.mempool is not None:
            self.allocator._graph_pool = None
            self.drop(graph)
