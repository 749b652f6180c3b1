"""TaggedAllocator: device memory in tags whose physical memory sleep releases and wake maps back at the same addresses.

Mechanism only: the controller decides which tags are backed up or discarded; this class does
what it is told, all or nothing per call (backup, restore) or per tag (release), and rolls back
its own mappings when a step fails. It meets ``GraphPoolMemory`` on the CUDA and simulated drivers.
The allocation table lives in the native library (:mod:`torpor.allocator.native.table`), which
also serves torch's malloc and free without the GIL. The class has no base class: it holds the
public methods and owns its parts: :class:`TagBook` (each tag's record, the lock, this thread's
tag), :class:`HostArena` and :class:`Stager` (pinned host memory), :class:`GraphPoolState`,
:class:`TorchBinding` (torch's pools, made on first use on CUDA), :class:`SleepWake` (the
sleep/wake cycle) and :class:`KeepBook` (ranges kept across a discard, around the cycle's release).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from torpor.allocator.host.offload import HostArena, HostPolicy
from torpor.allocator.host.staging import Stager
from torpor.allocator.kept_ranges.keeping import KeepBook
from torpor.allocator.kept_ranges.ranges import KeepSource
from torpor.allocator.native.cuda_driver import CudaDriver
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.cycle import SleepWake
from torpor.allocator.sleepwake.tagbook import TagBook, TagState
from torpor.allocator.torchside.binding import TorchBinding
from torpor.allocator.torchside.graphstate import GraphPoolState
from torpor.allocator.torchside.pools import TorchPools
from torpor.errors import AllocatorError, DriverError, TagNotAwake
from torpor.graphcapture import CaptureHandle, CaptureObserver, PoolId
from torpor.statemachine.core.policy import CUDAGRAPH, DEFAULT_TAG
from torpor.statemachine.core.protocol import DeviceMemory, TagUsage, Transfer
from torpor.units import MiB

logger = logging.getLogger("torpor.allocator")
GRAPH_TAG = CUDAGRAPH  # the graph pool's tag (the name lives in torpor.statemachine.core.policy)


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


class TaggedAllocator:
    """Tagged device memory with sleep (backup, release) and wake (restore) per tag; see the module docstring.

    ``driver``: None means :class:`~torpor.allocator.native.cuda_driver.CudaDriver`. ``host``: the
    pinned-host policy. ``group_bytes``: bytes per pipelined copy group. ``piece_bytes``: the largest
    single mapping a wake makes for a tag with a backup (a discarded tag's allocations are mapped whole).
    ``slab_bytes``: the largest slab shared by one-granule allocations (at most 64 granules; 0 maps each
    allocation on its own). ``capture_observers``: called with the pool id whenever a capture into this
    allocator's graph pool starts (more with :meth:`on_capture`).
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
        capture_observers: Iterable[CaptureObserver] = (),
    ) -> None:
        if driver is None:
            driver = CudaDriver()
        self.driver = driver
        self.table = NativeTable(driver, slab_bytes)
        self.host = HostArena(driver, host)
        self.stager = Stager(driver, self.host)
        self.group_bytes = group_bytes
        self.piece_bytes = piece_bytes
        self.slabs = SlabStats(self.table)
        self.default_device = default_device
        self.book = TagBook(self.table)
        self.graphs = GraphPoolState(self.book, capture_observers)
        self.torch_binding = TorchBinding(self)
        self._granularity = functools.cache(self.table.granularity)
        parts = (driver, self.table, self.host, self.stager, self.book, self.torch_binding, self._granularity)
        self.sleepwake = SleepWake(*parts, group_bytes=group_bytes, piece_bytes=piece_bytes)
        self.keeping = KeepBook(driver, self.table, self.book)
        self.closed = False

    # -- the raw path -------------------------------------------------------------------

    def granularity(self, device: int | None = None) -> int:
        """Mapping granularity of ``device`` (allocation sizes are rounded up to it)."""
        return self._granularity(self.default_device if device is None else device)

    def current_tag(self) -> str | None:
        """The innermost tag of :meth:`use_memory_pool` (or the graph pool) on this thread."""
        return self.book.current()

    def tag_state(self, tag: str) -> TagState:
        """Python's record of ``tag`` (its backup), made on first use."""
        return self.book.state(tag)

    def allocate(self, nbytes: int, tag: str | None = None, device: int | None = None) -> int:
        """Map ``nbytes`` (rounded up to the granularity) under ``tag``; return the address."""
        tag = (self.current_tag() or DEFAULT_TAG) if tag is None else tag  # "" is refused, not the default
        dev = self.default_device if device is None else device
        if nbytes <= 0:
            msg = f"cannot allocate {nbytes} bytes"
            raise AllocatorError("allocate", tag, msg)
        self.tag_state(tag)
        try:
            address = self.table.alloc(tag, dev, nbytes)
        except AllocatorError as exc:
            asleep = self.book.not_awake(tag)
            if asleep is None:
                raise
            raise TagNotAwake(tag, *asleep, operation="allocate", detail=f"{nbytes} bytes") from exc
        if tag not in self.host.policy.prepin_exclude:
            self.grow_host()
        return address

    def free(self, address: int) -> None:
        """Free an allocation (its mapping goes with its last user); while its tag is released only its address range.

        Its host backup, if any, goes back at once (a free torch makes through the
        library's free returns it at the next wake or dropped backup).
        """
        self.table.free(address)
        with self.book.lock:
            for record in self.book.records.values():
                if record.pieces:
                    self.sleepwake.forget(record, {address})

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
        """Write bytes at a device address (through the driver; tests and demos).

        At an address of a tag asleep or going to sleep: :class:`~torpor.errors.TagNotAwake` naming the tag, its state and the
        sleep (the driver's own error is its cause).
        """
        try:
            self.driver.write(address, data)
        except DriverError as exc:
            tag = self.book.owner(address)
            asleep = self.book.not_awake(tag) if tag is not None else None
            if tag is None or asleep is None:
                raise
            raise TagNotAwake(tag, *asleep, operation="write", detail=f"{len(data)} bytes at {address:#x}") from exc

    def grow_host(self) -> None:
        """Raise the pin-ahead target to the tagged bytes (tags outside the policy's ``prepin_exclude``)."""
        self.host.want(self.book.tagged_bytes(self.host.policy.prepin_exclude))

    # -- pools ------------------------------------------------------------------------------

    @contextmanager
    def use_memory_pool(self, tag: str) -> Iterator[None]:
        """Route this thread's allocations to ``tag`` (torch tensors on CUDA; :meth:`allocate` everywhere); nested: inner wins.

        Only while ``tag`` is awake: a block of a tag that is asleep or going to sleep
        raises :class:`~torpor.errors.TagNotAwake` at its start, and a sleep of the tag
        waits for the blocks open in other threads (:meth:`close_doors`).
        """
        self.tag_state(tag)
        self.book.enter_block(tag)
        try:
            with self.book.routed(tag):
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
                    if tag not in self.host.policy.prepin_exclude:
                        self.grow_host()  # torch's allocations in the block never call Python: pin ahead for them now
        finally:
            self.book.leave_block(tag)

    def empty_cache(self, tags: Sequence[str] | None = None) -> int:
        """Give back the free cached segments of ``tags`` (None: all) that no open block uses; the bytes.

        What ``torch.cuda.empty_cache()`` does for torch's own pool, for the tags' pools (that call does this
        too once the torch side exists: ``empty_cache_hook``). Safe with kernels still queued: each segment's
        stream is waited for first (Invariant: stream-ordered trim). Without torch there is no cache: 0.
        """
        pools = self._torch
        if pools is None:
            return 0
        return pools.empty_cache(None if tags is None else list(tags))

    def close_doors(self, tags: Sequence[str], cause: str, timeout: float) -> None:
        """Refuse new ``use_memory_pool`` blocks of ``tags`` and wait up to ``timeout`` s for the open ones to end.

        :class:`~torpor.errors.BlocksOpen` names the blocks still open (in another thread past the wait, or in
        this one); nothing is touched then. ``cause`` names the sleep in later refusals. The controller calls
        this before a sleep takes the book's lock (Invariant: the allocator's lock order).
        """
        self.book.close_doors(tags, cause, timeout)

    def open_doors(self, tags: Sequence[str]) -> None:
        """The sleep that closed the doors ended: blocks of ``tags`` may start wherever the tag is awake again."""
        self.book.open_doors(tags)

    @contextmanager
    def use_cudagraph_pool(self) -> Iterator[PoolId]:
        """Yield the graph pool's id for ``torch.cuda.graph(pool=...)``; allocations inside are tagged cudagraph.

        The allocator's capture observers (``capture_observers``, :meth:`on_capture`) are told the id first.
        """
        make = (lambda: self._torch_pools().new_graph_pool()) if self._on_cuda() else None
        pool = self.graphs.start_capture(make)
        with self.book.routed(GRAPH_TAG):
            self.host.pause()  # no pinning while a graph is captured
            try:
                yield pool.id
            finally:
                self.host.resume()

    @contextmanager
    def capture_into_pool(self, site: str) -> Iterator[CaptureHandle]:
        """Context for capturing graphs at ``site``: yields a :class:`CaptureHandle` (a pool id that records graphs)."""
        with self.use_cudagraph_pool() as pool_id:
            pool = self.graphs.current
            if pool is None:  # released by another thread mid-capture
                msg = f"the cudagraph pool was released while capturing at {site!r}"
                raise AllocatorError("capture", GRAPH_TAG, msg)
            yield CaptureHandle(pool_id, site, pool.record)

    def on_capture(self, observer: CaptureObserver) -> Callable[[], None]:
        """Call ``observer(pool_id)`` whenever a capture into this allocator's graph pool starts; returns its remover.

        A failing observer is logged and never breaks the capture. The process-wide
        NCCL hook is the integration's: ``torpor.hooks.set_nccl_graph_pool_hook``.
        """
        return self.graphs.observers.add(observer)

    def cudagraph_pool_holders(self) -> list[str]:
        """Everything that still references the graph pool (empty when it can be released)."""
        return self.graphs.holders()

    def cudagraph_pool_id(self) -> PoolId | None:
        """The current graph pool's id, None before the first capture or after a release."""
        return self.graphs.pool_id()

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool once nothing references it; return the bytes it held; the next capture starts afresh."""
        return self.graphs.release(lambda pool: self._torch_pools().drop(pool), self.free)

    # -- the memory protocol: the sleep/wake cycle, keeping around its release and restore --------

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Copy each tag to pinned host memory (copies finish before :meth:`release` unmaps); all or nothing."""
        return self.sleepwake.backup(tags)

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Release each tag's physical memory, per tag all or nothing; a tag without a backup keeps its sourced ranges."""
        with self.book.lock:
            saved = self.keeping.save(tags)
            try:
                out = self.sleepwake.release(tags)
            except BaseException:
                self.keeping.unsave(saved)
                raise
            return self.keeping.counted(out, saved)

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Map each tag back at its addresses and copy its backup (or kept ranges) in; all or nothing, backups kept."""
        with self.book.lock:
            fresh = self.keeping.to_load(tags)
            out = self.sleepwake.restore(tags)
            self.keeping.load(fresh, tags, self.sleepwake.release)  # a failed copy releases the tags again
            return self.keeping.counted(out, fresh)

    def drop_backup(self, tags: Sequence[str]) -> None:
        """Mark the tags' backups stale (their host extents and kept copies go); a frozen tag takes allocations again."""
        with self.book.lock:
            self.sleepwake.drop_backup(tags)
            self.keeping.dropped(tags)

    def keep(self, tag: str, source: KeepSource) -> Callable[[], None]:
        """Keep ``source``'s ranges of ``tag`` whenever ``tag`` is released without a backup; returns its remover."""
        return self.keeping.keep(tag, source)

    def track(self, module: object, tag: str = "weights", *, check: bool = True) -> KeepSource:
        """Keep what no ``state_dict`` reload restores of ``module`` (a torch module, or any :class:`KeepSource`).

        Returns the source: for a module a ``ModuleTracker``, whose ``check_reloaded()`` names each
        parameter the reload left unwritten (``check``) and whose ``untrack()`` stops keeping it.
        """
        return self.keeping.track(module, tag, check=check)

    def kept_bytes(self, tag: str | None = None) -> int:
        """Host bytes kept now for released tags (of ``tag``, or of all)."""
        return self.keeping.kept_bytes(tag)

    def kept_names(self, tag: str) -> list[str]:
        """What the kept copy of ``tag`` holds (the sources' names), empty when nothing is kept."""
        return self.keeping.kept_names(tag)

    def usage(self) -> dict[str, TagUsage]:
        """Bytes per tag: resident, on the host, or discarded, and the number of allocations."""
        return self.book.usage()

    def pinned_bytes(self) -> int:
        """Host bytes held for backups (used or kept for reuse): pinned, or being pinned after a staged sleep."""
        return self.host.held_bytes()

    def wait_host_ready(self, timeout: float | None = None) -> bool:
        """Block until pinning ahead caught up with the tagged memory; False on timeout."""
        self.grow_host()
        return self.host.wait_ready(timeout)

    def configure_host(
        self, *, prepin: bool, limit_bytes: int | None, prepin_exclude: frozenset[str] = frozenset()
    ) -> None:
        """Apply the controller's host-memory policy to the arena (pinning ahead starts at once when asked).

        ``prepin_exclude``: tags whose growth does not pin ahead (the controller
        passes the tags its policy never backs up).
        """
        self.host.configure(prepin=prepin, limit_bytes=limit_bytes, prepin_exclude=frozenset(prepin_exclude))
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
        return self.table.errors()  # the native table's own mutex: no wait on a sleep or wake in another thread

    def close(self) -> None:
        """Teardown: unmap what is mapped, free reservations and pinned memory (also while asleep)."""
        self.keeping.close()  # kept copies of discarded tags
        with self.book.lock:
            for record in self.book.records.values():
                self.sleepwake.settle(record)
            if self.torch_binding.current is not None:
                self.graphs.detach()
                self.torch_binding.close()  # torch frees its cached segments through the native free
            self.stager.abort()
            failed = self.table.close()
            if failed:
                logger.error("%d driver call(s) failed while tearing the allocator down", failed)
            self.host.close()
            self.closed = True

    # -- internals ----------------------------------------------------------------------------

    def _on_cuda(self) -> bool:
        return getattr(self.driver, "name", "") == "cuda"

    def _torch_pools(self) -> TorchPools:
        return self.torch_binding.pools()

    @property
    def _torch(self) -> TorchPools | None:
        """The torch pools, None before the first use on CUDA."""
        return self.torch_binding.current
