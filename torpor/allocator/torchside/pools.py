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
import functools
import gc
import logging
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torpor.allocator.native.cuda_driver import _cu
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.tagbook import TagBook
from torpor.allocator.torchside.graphpool import GraphPool
from torpor.allocator.torchside.graphstate import GraphPoolState
from torpor.allocator.torchside.trim import BlockPool, BlockPools, trim_enabled
from torpor.extras import require
from torpor.statemachine.core.policy import CUDAGRAPH

logger = logging.getLogger("torpor.allocator")
_KEEP_ALIVE: list[object] = []  # torch allocators made on native slots: never collected
_LIVE: weakref.WeakSet[TorchPools] = weakref.WeakSet()  # what torch.cuda.empty_cache() also empties (empty_cache_hook)
_HOOK_LOCK = threading.Lock()


def empty_cache_hook() -> None:
    """Make ``torch.cuda.empty_cache()`` also give back the free segments of every live allocator's idle pools.

    Torch's ``emptyCache`` releases its own pool's cached segments and those of pools
    no longer referenced, never the cached segments of a live ``MemPool`` (torch 2.11:
    ``release_cached_blocks`` walks ``graph_pools_freeable`` only), so without this the
    call users make returns nothing of a tag. Installed once per process, the first time
    a torch side is made; torch's own call runs first, unchanged.
    """
    import torch

    with _HOOK_LOCK:
        original = torch.cuda.memory.empty_cache
        if getattr(original, "__torpor__", False):
            return

        @functools.wraps(original)
        def empty_cache() -> None:
            original()
            for pools in list(_LIVE):
                try:
                    pools.empty_cache()
                except Exception:  # torch's own part is done; torpor's is best effort here
                    logger.exception("torpor: giving back free segments at torch.cuda.empty_cache() failed")

        empty_cache.__torpor__ = True  # type: ignore[attr-defined]
        torch.cuda.memory.empty_cache = empty_cache
        torch.cuda.empty_cache = empty_cache


def segments(mempool: Any) -> list[dict[str, Any]]:
    """Torch's snapshot of one pool: its segments, each with its blocks (without traces where torch allows)."""
    try:
        found = mempool.snapshot(include_traces=False)
    except TypeError:  # torch before include_traces
        found = mempool.snapshot()
    return list(found)


def mark_streams(streams: set[tuple[int, int]]) -> object:
    """Where the work queued so far on each (device, stream handle) ends: an event per busy stream (none if idle).

    Asked in relaxed capture mode, so a capture in another thread is not broken by it.
    None when a stream cannot be asked (the segments then wait for a sleep, which synchronizes).
    """
    import torch

    events = []
    try:
        with relaxed_capture():
            for device, handle in sorted(streams):
                if handle:
                    stream: Any = torch.cuda.ExternalStream(handle, device=device)  # type: ignore[no-untyped-call]
                else:
                    stream = torch.cuda.default_stream(device)
                if stream.query():  # everything queued there has run: nothing can touch the segments any more
                    continue
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
    except Exception as exc:  # a broken context or a capturing stream: trim nothing now
        logger.debug("cannot mark free segments for trimming: %s", exc)
        return None
    return events


def wait_marked(token: object) -> bool:
    """Block until every event of :func:`mark_streams` has completed; False for None (never marked) or a failed wait.

    In relaxed capture mode: a capture in another thread stays valid (an event wait, not a device synchronize).
    """
    if not isinstance(token, list):
        return False
    try:
        with relaxed_capture():
            for event in token:
                event.synchronize()
    except Exception as exc:  # a broken context: the segments stay until a sleep
        logger.debug("cannot wait for marked free segments: %s", exc)
        return False
    return True


def device_free(device: int) -> int:
    """The device's free memory in bytes, as the driver reports it (``cudaMemGetInfo``; no stream work)."""
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def streams_done(token: object) -> bool:
    """Whether every event of :func:`mark_streams` has completed (False for None: never trimmed at a boundary)."""
    if not isinstance(token, list):
        return False
    if not token:  # every stream was idle when marked
        return True
    try:
        with relaxed_capture():
            return all(event.query() for event in token)
    except Exception as exc:
        logger.debug("cannot query the events of marked segments: %s", exc)
        return False


@contextmanager
def relaxed_capture() -> Iterator[None]:
    """This thread's stream-capture mode relaxed inside (a capture in another thread stays valid), restored after."""
    cu = _cu()
    err, previous = cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        if err == cu.CUresult.CUDA_SUCCESS:
            cu.cuThreadExchangeStreamCaptureMode(previous)


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


class AllocatorParts(Protocol):
    """What the torch side uses of a ``TaggedAllocator``'s parts: its table, driver, tag book and graph-pool state.

    :class:`~torpor.allocator.torchside.binding.TorchBinding` is handed them by keyword and hands them on here.
    """

    @property
    def table(self) -> NativeTable: ...

    @property
    def driver(self) -> Driver: ...

    @property
    def book(self) -> TagBook: ...

    @property
    def graphs(self) -> GraphPoolState: ...


class TorchPools:
    """One pluggable allocator per tag, a MemPool per open ``use_memory_pool`` block (reused: :mod:`torpor.allocator.torchside.trim`), the graph pools.

    It works on the parts of one allocator (:class:`AllocatorParts`: its table, driver, tag
    book and graph-pool state), read through a protocol: the torch side sits below
    ``TaggedAllocator`` and does not import it.
    """

    def __init__(self, allocator: AllocatorParts) -> None:
        require("torch", "TaggedAllocator's CUDA memory pools (use_memory_pool, capture)")
        self.table = table = allocator.table
        self.driver = allocator.driver
        self.book = allocator.book
        self.graphs = allocator.graphs
        self._allocators: dict[str, Any] = {}
        self.blocks = BlockPools(
            self._new_pool,
            table.trim,
            table.untrim,
            segments,
            enabled=trim_enabled(),
            mark=mark_streams,
            done=streams_done,
            pend=table.pend,
            unpend=table.unpend,
            wait=wait_marked,
            free_bytes=device_free,
        )
        self._local = threading.local()
        self._devices: set[int] = set()
        self._lock = threading.RLock()
        _LIVE.add(self)
        empty_cache_hook()
        atexit.register(self.close)  # pools go while the library's context is alive (torch frees into it)

    def torch_allocator(self, tag: str) -> Any:
        """The ``_cuda_CUDAAllocator`` whose malloc/free allocate under ``tag`` (made once per tag)."""
        found = self._allocators.get(tag)  # written once per tag, under the lock: read without it after
        if found is not None:
            return found
        import torch

        with self._lock:
            found = self._allocators.get(tag)
            if found is None:
                self.book.state(tag)
                malloc_ptr, free_ptr = self.table.slot(tag)
                found = torch._C._cuda_customAllocator(malloc_ptr, free_ptr)
                _KEEP_ALIVE.append(found)
                self._allocators[tag] = found
            return found

    def _new_pool(self, tag: str) -> Any:
        import torch

        # the tag's torch allocator exists before the block's lock is taken (use): only the pool is made under it
        return torch.cuda.MemPool(self._allocators[tag])

    @contextmanager
    def use(self, tag: str) -> Iterator[None]:
        """Route this thread's torch allocations to a fresh pool of ``tag``; an inner tag wins over an outer one.

        Entering and leaving trim the tag's idle pools (:mod:`torpor.allocator.torchside.trim`).
        """
        import torch

        stack: list[list[Any]] = self._local.__dict__.setdefault("stack", [])
        device = torch.cuda.current_device()
        if device not in self._devices:  # the copy/pinning side: this device's context and copy stream, made now
            self.driver.prepare_device(device)
            self._devices.add(device)
        self.torch_allocator(tag)  # takes the allocator's lock on first use: before the block's lock
        block = self.blocks.enter(tag)
        try:
            if stack:  # torch serves the first matching pool: step out of the outer one while inside
                stack[-1][1].__exit__(None, None, None)
            entry: list[Any] = [block, _enter_pool(block)]
            stack.append(entry)
            try:
                yield
            finally:
                stack.pop()
                entry[1].__exit__(None, None, None)
                entry[1] = None
                if stack:
                    stack[-1][1] = _enter_pool(stack[-1][0])
        finally:
            self.blocks.leave(block)

    def trim(self, tags: list[str] | None = None, *, settled: bool = True) -> int:
        """Give back the free segments of pools no open block uses (of ``tags``, or all); the bytes.

        ``settled``: the devices were synchronized, so no queued kernel can touch them (:mod:`torpor.allocator.torchside.trim`).
        """
        return self.blocks.trim(tags, settled=settled)

    def empty_cache(self, tags: list[str] | None = None) -> int:
        """Give back the free segments of the idle pools (of ``tags``, or all), as ``torch.cuda.empty_cache()`` does its own; the bytes.

        Safe while kernels are queued: each segment's stream is waited for first (an event,
        as torch's ``cudaFree`` of a cached segment waits; no device synchronize, so a
        capture in another thread stays valid). Segments of a pool a block uses now stay
        (torch may hand them out). Nothing while this thread's stream captures a graph.
        """
        import torch

        if not self.blocks.counts()[0] or torch.cuda.is_current_stream_capturing():
            return 0
        return self.blocks.empty(tags)

    def live_ranges(self, tag: str) -> dict[int, list[tuple[int, int]]] | None:
        """Segment address -> its blocks in use, over the pools of ``tag`` that may hold any (None: torch has none)."""
        pools = self.blocks.pools(tag)
        if not pools:
            return None
        return {int(seg["address"]): live_blocks(seg) for pool in pools for seg in segments(pool)}

    def new_graph_pool(self) -> GraphPool:
        """A fresh MemPool for the graph pool (tag cudagraph) wrapped as a :class:`GraphPool`."""
        import torch

        mempool = torch.cuda.MemPool(self.torch_allocator(CUDAGRAPH))
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
        """Drop every tag's MemPool so torch returns their cached segments (teardown)."""
        import torch

        _LIVE.discard(self)
        if self.blocks.counts()[0]:
            torch.cuda.synchronize()
            self.blocks.clear()
            gc.collect()
        graph = self.graphs.detach()  # teardown: the graph pool's MemPool goes with the others
        if graph is not None and graph.mempool is not None:
            self.drop(graph)


def _enter_pool(block: BlockPool) -> Any:
    """Enter torch's ``use_mem_pool`` for the block's pool; the context manager (the caller exits it)."""
    import torch

    ctx = torch.cuda.use_mem_pool(block.mempool)
    ctx.__enter__()
    return ctx
