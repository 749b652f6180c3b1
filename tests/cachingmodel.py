"""A model of torch's caching allocator and of a device stream, over torpor's allocator on the simulated driver.

What the model keeps of torch (CUDACachingAllocator with a pluggable allocator per MemPool):
- allocations route to the pool of this thread's innermost ``use_mem_pool`` (thread-local, as
  ``_cuda_beginAllocateCurrentThreadToPool``); each pool serves them from the free blocks of its own
  cached segments, first fit, **without calling malloc**; only when none fits does it call the
  pluggable malloc (torpor's native table) for a new segment;
- a free puts the block back in its pool's cache at once (stream order: a kernel queued before
  the free may still touch it); segments stay cached; the pool snapshot lists segments with
  ``device``, ``stream``, ``allocated_size`` and blocks as ``active_allocated`` or ``inactive``.

The device is one stream: kernels (writes and reads of a tensor's bytes) are queued and run later,
in order, when the schedule lets the device run or when torpor synchronizes the device. A kernel
that reads or writes unmapped memory raises in the simulated driver: the model records it as a
lost CUDA context. ``ModelPools`` stands where ``torpor.allocator.torchside.pools.TorchPools`` stands on
CUDA, on torpor's own :class:`~torpor.allocator.torchside.trim.BlockPools`, so the code under test is the
real trimming, doors, native table and sleep/wake.
"""

from __future__ import annotations

import inspect
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torpor.allocator import SimDriver, TaggedAllocator
from torpor.allocator.native import library as native
from torpor.allocator.torchside.pools import live_blocks
from torpor.allocator.torchside.trim import BlockPools
from torpor.errors import DriverError

ALIGN = 512


class ModelStream:
    """The device's one stream: kernels queued in order, run when the device is let run or synchronized."""

    def __init__(self) -> None:
        self.queue: deque[Callable[[], None]] = deque()
        self.queued = 0
        self.ran = 0
        self.faults: list[str] = []
        self.lock = threading.Lock()

    def launch(self, kernel: Callable[[], None]) -> None:
        with self.lock:
            self.queue.append(kernel)
            self.queued += 1

    def run(self, n: int | None = None) -> None:
        """Run the next ``n`` queued kernels (all when None)."""
        while True:
            with self.lock:
                if not self.queue or n == 0:
                    return
                kernel = self.queue.popleft()
                self.ran += 1
                if n is not None:
                    n -= 1
            try:
                kernel()
            except DriverError as exc:  # the real device: an illegal address, the context lost
                self.faults.append(str(exc))


class ModelDriver(SimDriver):
    """The simulated driver whose synchronize runs the model stream first (what a device synchronize does)."""

    def __init__(self, stream: ModelStream, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stream = stream

    def _synchronize(self, device: int) -> None:
        self.stream.run()
        super()._synchronize(device)


@dataclass
class Segment:
    """A segment torch got from malloc: its blocks as [offset, size, live]."""

    address: int
    size: int
    blocks: list[list[int]] = field(default_factory=list)


@dataclass
class ModelPool:
    """A MemPool stand-in: its tag and cached segments."""

    tag: str
    segments: list[Segment] = field(default_factory=list)


@dataclass
class Tensor:
    """A live allocation: its pool, segment, block, the bytes it was last written with."""

    pool: ModelPool
    segment: Segment
    block: list[int]
    pattern: int
    intact: bool = True  # False once a sleep discarded its tag (its bytes are gone)

    @property
    def address(self) -> int:
        return self.segment.address + self.block[0]

    @property
    def size(self) -> int:
        return self.block[1]


class ModelTorch:
    """Torch's caching allocator, as far as torpor depends on it (see the module docstring)."""

    def __init__(self, alloc: TaggedAllocator, stream: ModelStream, segment_bytes: int) -> None:
        self.alloc = alloc
        self.stream = stream
        self.segment_bytes = segment_bytes
        self.local = threading.local()
        self.lock = threading.Lock()  # torch's allocator mutex (the native malloc runs under it)

    def current(self) -> ModelPool | None:
        stack: list[ModelPool] = getattr(self.local, "stack", [])
        return stack[-1] if stack else None

    @contextmanager
    def use_mem_pool(self, pool: ModelPool) -> Iterator[None]:
        stack = self.local.__dict__.setdefault("stack", [])
        stack.append(pool)
        try:
            yield
        finally:
            stack.pop()

    def malloc(self, nbytes: int) -> Tensor | None:
        """A block of this thread's pool: from its cache if a free block fits, else a new segment (None: refused)."""
        pool = self.current()
        if pool is None:
            return None
        size = -(-nbytes // ALIGN) * ALIGN
        with self.lock:
            for seg in pool.segments:
                for i, block in enumerate(seg.blocks):
                    if not block[2] and block[1] >= size:  # served from the cache: no malloc, no question asked
                        if block[1] > size:
                            seg.blocks.insert(i + 1, [block[0] + size, block[1] - size, 0])
                            block[1] = size
                        block[2] = 1
                        return Tensor(pool, seg, block, 0)
            seg_size = max(self.segment_bytes, -(-size // self.segment_bytes) * self.segment_bytes)
            try:
                address = self.alloc._table.alloc(pool.tag, 0, seg_size)  # the pluggable malloc: torpor's table
            except Exception:  # NULL: torch raises its out-of-memory error
                return None
            seg = Segment(address, seg_size, [[0, size, 1]])
            if seg_size > size:
                seg.blocks.append([size, seg_size - size, 0])
            pool.segments.append(seg)
            return Tensor(pool, seg, seg.blocks[0], 0)

    def free(self, tensor: Tensor) -> None:
        """Back into the pool's cache at once (adjacent free blocks merged)."""
        with self.lock:
            tensor.block[2] = 0
            merged: list[list[int]] = []
            for block in tensor.segment.blocks:
                if merged and not merged[-1][2] and not block[2]:
                    merged[-1][1] += block[1]
                else:
                    merged.append(block)
            tensor.segment.blocks[:] = merged

    def snapshot(self, pool: ModelPool) -> list[dict[str, Any]]:
        with self.lock:
            out = []
            for seg in pool.segments:
                blocks = [
                    {"address": seg.address + o, "size": n, "state": "active_allocated" if live else "inactive"}
                    for o, n, live in seg.blocks
                ]
                allocated = sum(n for _, n, live in seg.blocks if live)
                out.append(
                    {
                        "address": seg.address,
                        "total_size": seg.size,
                        "allocated_size": allocated,
                        "device": 0,
                        "stream": 0,
                        "blocks": blocks,
                    }
                )
            return out

    def write(self, tensor: Tensor, pattern: int) -> None:
        """Queue a kernel that fills the tensor with ``pattern``."""
        tensor.pattern = pattern
        address, data = tensor.address, bytes([pattern]) * tensor.size
        self.stream.launch(lambda: self.alloc.driver.write(address, data))

    def read(self, tensor: Tensor, wrong: list[str]) -> None:
        """Queue a kernel that reads the tensor back; a mismatch is recorded in ``wrong``."""
        address, size, pattern = tensor.address, tensor.size, tensor.pattern

        def kernel() -> None:
            got = self.alloc.driver.read(address, size)
            if got != bytes([pattern]) * size:
                wrong.append(f"{address:#x}+{size}: wrote {pattern}, read {got[:1].hex()}...")

        self.stream.launch(kernel)


class ModelPools:
    """What ``TorchPools`` is on CUDA, over the model: a pool per open block from torpor's BlockPools."""

    def __init__(self, alloc: TaggedAllocator, torch: ModelTorch) -> None:
        self.torch = torch
        stream = torch.stream
        kwargs: dict[str, Any] = {}
        accepted = inspect.signature(BlockPools).parameters
        if "mark" in accepted:
            kwargs = {"mark": lambda streams: stream.queued, "done": lambda token: stream.ran >= int(token)}
        if "asleep" in accepted:  # the same model runs on the BlockPools before issue 26, which it must fail
            kwargs["asleep"] = lambda tag: alloc._table.usage(tag).state != native.ACTIVE
        self.blocks = BlockPools(ModelPool, alloc._table.trim, alloc._table.untrim, torch.snapshot, True, **kwargs)

    @contextmanager
    def use(self, tag: str) -> Iterator[None]:
        block = self.blocks.enter(tag)
        try:
            with self.torch.use_mem_pool(block.mempool):
                yield
        finally:
            self.blocks.leave(block)

    def trim(self, tags: list[str] | None = None, *, settled: bool = True) -> int:
        if "settled" in inspect.signature(self.blocks.trim).parameters:
            return self.blocks.trim(tags, settled=settled)
        return self.blocks.trim(tags)

    def empty_cache(self, tags: list[str] | None = None) -> int:
        """``torch.cuda.empty_cache()``'s part for the pools (run the stream first: its marks are waited for)."""
        return self.blocks.empty(tags)

    def live_ranges(self, tag: str) -> dict[int, list[tuple[int, int]]] | None:
        pools = self.blocks.pools(tag)
        if not pools:
            return None
        return {int(s["address"]): live_blocks(s) for pool in pools for s in self.torch.snapshot(pool)}

    def close(self) -> None:
        self.blocks.clear()


def model_allocator(stream: ModelStream, granularity: int, capacity: int) -> tuple[TaggedAllocator, ModelTorch]:
    """A TaggedAllocator on the model driver whose torch side is the model (no torch needed)."""
    driver = ModelDriver(stream, capacity=capacity, granularity=granularity)
    alloc = TaggedAllocator(driver)
    torch = ModelTorch(alloc, stream, granularity)  # one granule: torch's 2 MiB small-pool segments, on slabs
    alloc._torch._pools = ModelPools(alloc, torch)  # type: ignore[assignment]
    return alloc, torch
