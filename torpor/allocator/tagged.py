"""TaggedAllocator: device memory in tags whose physical memory sleep releases and wake maps back at the same addresses.

Mechanism only: the controller decides which tags are backed up or discarded;
this class does what it is told, all or nothing per call (backup, restore) or
per tag (release), and rolls back its own mappings when a step fails. It meets
``torpor.statemachine.protocol.GraphPoolMemory`` and runs unchanged on
:class:`~torpor.allocator.cuda_driver.CudaDriver` and
:class:`~torpor.allocator.sim.SimDriver`.

The allocation table (allocations, mappings, address arenas, slabs, each tag's
state) lives in the native library (:mod:`torpor.allocator.table`), which also
serves torch's malloc and free without the GIL. This class orchestrates sleep
and wake over it (:mod:`torpor.allocator.sleepwake`): the copies and pinned
host memory are Python's (the driver's copy stream), the mappings the library's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from torpor.allocator import native
from torpor.allocator.callbacks import TorchPools
from torpor.allocator.cuda_driver import CudaDriver
from torpor.allocator.driver import Driver
from torpor.allocator.errors import AllocatorError
from torpor.allocator.graphpool import CaptureHandle, GraphPool, PoolId, call_graph_pool_hooks
from torpor.allocator.offload import HostArena, HostPolicy
from torpor.allocator.sleepwake import SleepWake, TagState
from torpor.allocator.table import NativeTable
from torpor.errors import PoolBusy
from torpor.statemachine.protocol import DeviceMemory, TagUsage

logger = logging.getLogger("torpor.allocator")
MiB = 1 << 20
GRAPH_TAG = "cudagraph"


class SlabStats:
    """Slabs of one-granule allocations, as the native table reports them (see docs/allocator.md)."""

    def __init__(self, table: NativeTable) -> None:
        self._table = table

    def spare_bytes(self, tag: str | None = None) -> int:
        """Mapped bytes in live slabs that no allocation uses (of ``tag``, or of all)."""
        return self._table.stats(tag)[1]

    def count(self, tag: str | None = None) -> int:
        """Live slabs (of ``tag``, or of all)."""
        return self._table.stats(tag)[0]


class TaggedAllocator(SleepWake):
    """Tagged device memory with sleep (backup, release) and wake (restore) per tag; see the module docstring.

    ``driver``: None means :class:`~torpor.allocator.cuda_driver.CudaDriver`.
    ``host``: the pinned-host policy. ``group_bytes``: bytes per pipelined
    copy group. ``piece_bytes``: the largest single mapping made on wake.
    ``slab_bytes``: the largest slab shared by one-granule allocations (at most
    64 granules; 0 maps each allocation on its own).
    """

    def __init__(
        self,
        driver: Driver | None = None,
        *,
        host: HostPolicy | None = None,
        group_bytes: int = 64 * MiB,
        piece_bytes: int = 128 * MiB,
        slab_bytes: int = 64 * MiB,
        default_device: int = 0,
    ) -> None:
        if driver is None:
            driver = CudaDriver()
        self.driver = driver
        self.table = NativeTable(driver, slab_bytes)
        self.host = HostArena(driver, host)
        self.group_bytes = group_bytes
        self.piece_bytes = piece_bytes
        self.slabs = SlabStats(self.table)
        self.default_device = default_device
        self._lock = threading.RLock()
        self._tags: dict[str, TagState] = {}
        self._gran: dict[int, int] = {}
        self._local = threading.local()
        self._graph_pool: GraphPool | None = None
        self._pool_generation = 0
        self._torch: Any = None
        self._callback_errors: list[AllocatorError] = []
        self.closed = False

    # -- the raw path -------------------------------------------------------------------

    def granularity(self, device: int | None = None) -> int:
        """Mapping granularity of ``device`` (allocation sizes are rounded up to it)."""
        dev = self.default_device if device is None else device
        gran = self._gran.get(dev)
        if gran is None:
            gran = self._gran[dev] = self.table.granularity(dev)
        return gran

    def current_tag(self) -> str | None:
        """The innermost tag of :meth:`use_memory_pool` (or the graph pool) on this thread."""
        stack: list[str] = getattr(self._local, "tags", [])
        return stack[-1] if stack else None

    def tag_state(self, tag: str) -> TagState:
        """Python's record of ``tag`` (its backup), made on first use."""
        with self._lock:
            state = self._tags.get(tag)
            if state is None:
                self.table.tag_id(tag)
                state = self._tags[tag] = TagState()
            return state

    def allocate(self, nbytes: int, tag: str | None = None, device: int | None = None) -> int:
        """Map ``nbytes`` (rounded up to the granularity) under ``tag``; return the address."""
        tag = tag or self.current_tag() or "default"
        dev = self.default_device if device is None else device
        if nbytes <= 0:
            msg = f"cannot allocate {nbytes} bytes"
            raise AllocatorError("allocate", tag, msg)
        self.tag_state(tag)
        address = self.table.alloc(tag, dev, nbytes)
        if tag not in self.host.policy.prepin_exclude:
            self.grow_host()
        return address

    def free(self, address: int) -> None:
        """Free an allocation (its mapping goes with its last user); while its tag is released only its address range.

        Its host backup, if any, goes back at once (a free torch makes through the
        library's free returns it at the next wake or dropped backup).
        """
        self.table.free(address)
        with self._lock:
            for record in self._tags.values():
                if record.pieces:
                    self._forget(record, {address})

    def size_of(self, address: int) -> int:
        """Mapped size of the allocation at ``address``."""
        for a, n, _ in self.table.allocations():
            if a == address:
                return n
        msg = f"{address:#x} is not an allocation of this allocator"
        raise AllocatorError("size_of", None, msg)

    def read(self, address: int, nbytes: int) -> bytes:
        """Bytes at a device address (through the driver; tests and demos)."""
        return self.driver.read(address, nbytes)

    def write(self, address: int, data: bytes) -> None:
        """Write bytes at a device address (through the driver; tests and demos)."""
        self.driver.write(address, data)

    def grow_host(self) -> None:
        """Raise the pin-ahead target to the tagged bytes (tags outside ``prepin_exclude``)."""
        skip = self.host.policy.prepin_exclude
        total = sum(self.table.usage(t)[1] for t in list(self._tags) if t not in skip)
        self.host.want(total)

    # -- pools ------------------------------------------------------------------------------

    @contextmanager
    def use_memory_pool(self, tag: str) -> Iterator[None]:
        """Route this thread's allocations to ``tag`` (torch tensors on CUDA; :meth:`allocate` everywhere); nested: inner wins."""
        self.tag_state(tag)
        stack: list[str] = self._local.__dict__.setdefault("tags", [])
        stack.append(tag)
        torch_ctx = self._torch_pools().use(tag) if self._on_cuda() else None
        try:
            if torch_ctx is None:
                yield
            else:
                with torch_ctx:
                    yield
        except Exception as exc:
            pending = self.pending_errors()
            if pending:
                raise pending[-1] from exc
            raise
        finally:
            stack.pop()
            if tag not in self.host.policy.prepin_exclude:
                self.grow_host()  # torch's allocations in the block never call Python: pin ahead for them now

    @contextmanager
    def use_cudagraph_pool(self) -> Iterator[PoolId]:
        """Yield the graph pool's id for ``torch.cuda.graph(pool=...)``; allocations inside are tagged cudagraph."""
        pool = self._ensure_graph_pool()
        call_graph_pool_hooks(pool.id)
        stack: list[str] = self._local.__dict__.setdefault("tags", [])
        stack.append(GRAPH_TAG)
        self.host.pause()  # no pinning while a graph is captured
        try:
            yield pool.id
        finally:
            self.host.resume()
            stack.pop()

    @contextmanager
    def capture_into_pool(self, site: str) -> Iterator[CaptureHandle]:
        """Context for capturing graphs at ``site``: yields a :class:`CaptureHandle` (a pool id that records graphs)."""
        with self.use_cudagraph_pool() as pool_id:
            pool = self._graph_pool
            if pool is None:  # released by another thread mid-capture
                msg = f"the cudagraph pool was released while capturing at {site!r}"
                raise AllocatorError("capture", GRAPH_TAG, msg)
            yield CaptureHandle(pool_id, site, pool.record)

    def cudagraph_pool_holders(self) -> list[str]:
        """Everything that still references the graph pool (empty when it can be released)."""
        pool = self._graph_pool
        return pool.holders() if pool is not None else []

    def cudagraph_pool_id(self) -> PoolId | None:
        """The current graph pool's id, None before the first capture or after a release."""
        pool = self._graph_pool
        return pool.id if pool is not None else None

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool once nothing references it; return the bytes it held; the next capture starts afresh."""
        with self._lock:
            pool = self._graph_pool
            if pool is None:
                return 0
            state, before, _ = self.table.usage(GRAPH_TAG) if GRAPH_TAG in self._tags else (0, 0, 0)
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
            self._graph_pool = None
            if pool.mempool is not None:
                self._torch_pools().drop(pool)  # torch frees the segments through the native free
                left = self.table.usage(GRAPH_TAG)[1]
                if left:
                    logger.warning(
                        "%d bytes of the released graph pool are still allocated (tensors of it alive)", left
                    )
            elif GRAPH_TAG in self._tags:
                for address, _, _ in self.table.allocations(GRAPH_TAG):
                    self.free(address)
            after = self.table.usage(GRAPH_TAG)[1] if GRAPH_TAG in self._tags else 0
            return before - after

    def _ensure_graph_pool(self) -> GraphPool:
        with self._lock:
            self.tag_state(GRAPH_TAG)
            state, nbytes, _ = self.table.usage(GRAPH_TAG)
            if state == native.RELEASED:
                msg = f"cannot capture: the cudagraph pool is released (asleep, {nbytes} bytes on host); wake first"
                raise AllocatorError("capture", GRAPH_TAG, msg)
            if self._graph_pool is None:
                self._pool_generation += 1
                if self._on_cuda():
                    self._graph_pool = self._torch_pools().new_graph_pool()
                else:
                    self._graph_pool = GraphPool((-1, self._pool_generation))
            return self._graph_pool

    # -- the memory protocol (sleep and wake: SleepWake) -------------------------------------

    def usage(self) -> dict[str, TagUsage]:
        """Bytes per tag: resident, on the host, or discarded, and the number of allocations."""
        with self._lock:
            out = {}
            for tag, record in self._tags.items():
                state, n, count = self.table.usage(tag)
                if state != native.RELEASED:
                    out[tag] = TagUsage(n, 0, 0, count)
                elif record.backed_up:
                    out[tag] = TagUsage(0, n, 0, count)
                else:
                    out[tag] = TagUsage(0, 0, n, count)
            return out

    def pinned_bytes(self) -> int:
        """Pinned host bytes held for backups (used or kept for reuse)."""
        return self.host.pinned_bytes()

    def wait_host_ready(self, timeout: float | None = None) -> bool:
        """Block until pinning ahead caught up with the tagged memory; False on timeout."""
        self.grow_host()
        return self.host.wait_ready(timeout)

    def configure_host(self, *, prepin: bool, limit_bytes: int | None) -> None:
        """Apply the controller's host-memory policy to the arena (pinning ahead starts at once when asked)."""
        self.host.configure(prepin=prepin, limit_bytes=limit_bytes)
        if prepin:
            self.grow_host()

    def trim_host(self, background: bool = False) -> int:
        """Unpin host chunks that hold no backup; return the bytes given back (see :meth:`HostArena.trim`)."""
        return self.host.trim(background)

    def device_memory(self) -> DeviceMemory:
        """Device memory in use on the devices this allocator maps, and how much of it is torpor's (mapped) tags."""
        devices = {d for _, _, d in self.table.allocations()} | {self.default_device}
        mapped = self.table.stats()[2]
        total = in_use = 0
        for device in sorted(devices):
            free, size = self.driver.mem_info(device)
            total += size
            in_use += size - free
        return DeviceMemory(total, in_use, mapped)

    def pending_errors(self) -> list[AllocatorError]:
        """Errors of torch's malloc/free calls (in the native library) since the last call, and forget them."""
        with self._lock:
            errors, self._callback_errors = [*self._callback_errors, *self.table.errors()], []
            return errors

    def close(self) -> None:
        """Teardown: unmap what is mapped, free reservations and pinned memory (also while asleep)."""
        with self._lock:
            for record in self._tags.values():
                self._settle(record)
            if self._torch is not None:
                self._graph_pool = None
                self._torch.close()  # torch frees its cached segments through the native free
            failed = self.table.close()
            if failed:
                logger.error("%d driver call(s) failed while tearing the allocator down", failed)
            self.host.close()
            self.closed = True

    # -- internals ----------------------------------------------------------------------------

    def _live_blocks(self, tag: str) -> dict[int, list[tuple[int, int]]] | None:
        # The graph pool is backed up whole: blocks a capture freed are still the graphs' working memory.
        if self._torch is None or tag == GRAPH_TAG:
            return None
        found: dict[int, list[tuple[int, int]]] | None = self._torch.live_ranges(tag)
        return found

    def _on_cuda(self) -> bool:
        return getattr(self.driver, "name", "") == "cuda"

    def _torch_pools(self) -> Any:
        if self._torch is None:
            self._torch = TorchPools(self)
        return self._torch


def capture_context(allocator: TaggedAllocator, site: str) -> AbstractContextManager[CaptureHandle]:
    """Same as ``allocator.capture_into_pool(site)`` (a function form for integrations)."""
    return allocator.capture_into_pool(site)


def usage_total(usage: Mapping[str, TagUsage]) -> int:
    """Resident + host + discarded bytes over all tags."""
    return sum(u.resident + u.host + u.discarded for u in usage.values())
