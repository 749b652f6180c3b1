"""TaggedAllocator: device memory in tags whose physical memory sleep releases and wake maps back at the same addresses.

Mechanism only: the controller decides which tags are backed up or discarded; this class does
what it is told, all or nothing per call (backup, restore) or per tag (release), and rolls back
its own mappings when a step fails. It meets ``GraphPoolMemory`` on the CUDA and simulated drivers.
The allocation table lives in the native library (:mod:`torpor.allocator.native.table`), which
also serves torch's malloc and free without the GIL.

It is the one way into the allocator (docs/architecture.md, "The allocator's parts"): it has
no base class, holds the public methods and owns its parts, private and handed what they work
on by keyword. What a reader outside needs beyond the memory protocol is a method, a read-only
property or a view of :mod:`torpor.allocator.views`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager

from torpor.allocator.host.offload import HostArena, HostPolicy
from torpor.allocator.host.provider import HostProvider
from torpor.allocator.host.staging import Stager
from torpor.allocator.kept_ranges.keeping import KeepBook
from torpor.allocator.kept_ranges.ranges import KeepSource
from torpor.allocator.native.cuda_driver import CudaDriver
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import Live, NativeTable
from torpor.allocator.rawpath import RawPath
from torpor.allocator.routing import PoolRouting
from torpor.allocator.sleepwake.cycle import SleepWake
from torpor.allocator.sleepwake.tagbook import TagBook, TagState
from torpor.allocator.torchside.binding import TorchBinding
from torpor.allocator.torchside.graphstate import GraphPoolState
from torpor.allocator.views import BackupView, NativeEntry, SlabStats
from torpor.errors import AllocatorError
from torpor.graphcapture import CaptureHandle, CaptureObserver, PoolId
from torpor.statemachine.core.policy import CUDAGRAPH
from torpor.statemachine.core.protocol import DeviceMemory, TagUsage, Transfer
from torpor.units import MiB

logger = logging.getLogger("torpor.allocator")
GRAPH_TAG = CUDAGRAPH  # the graph pool's tag (the name lives in torpor.statemachine.core.policy)


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
        self._driver = driver
        self._default_device = default_device
        self._table = table = NativeTable(driver, slab_bytes)
        self._host = HostArena(driver, host)
        self._stager = Stager(driver, self._host)
        self._book = book = TagBook(table)
        self._graphs = GraphPoolState(book, capture_observers)
        self._torch = TorchBinding(table=table, driver=driver, book=book, graphs=self._graphs)
        self._granularity = functools.cache(table.granularity)
        self._cycle = SleepWake(
            driver=driver,
            table=table,
            host=self._host,
            stager=self._stager,
            book=book,
            torch=self._torch,
            granularity=self._granularity,
            group_bytes=group_bytes,
            piece_bytes=piece_bytes,
        )
        self._kept = KeepBook(driver=driver, table=table, book=book)
        self._slabs = SlabStats(table)
        self._backups = BackupView(book, self._host)
        self._native = NativeEntry(table)
        self._raw = RawPath(
            driver=driver, table=table, book=book, cycle=self._cycle, host=self._host, grow_host=self.grow_host
        )
        self._routing = PoolRouting(
            book=book,
            host=self._host,
            torch=self._torch,
            graphs=self._graphs,
            on_cuda=self.on_cuda,
            grow_host=self.grow_host,
            pending_errors=self.pending_errors,
        )

    # -- what it is built on ------------------------------------------------------------

    @property
    def driver(self) -> Driver:
        """The driver it maps and copies through (the one given, or the CUDA driver)."""
        return self._driver

    @property
    def on_cuda(self) -> bool:
        """Whether that driver is CUDA's (torch's pools exist only there); False on the simulated device."""
        return self._driver.is_cuda

    @property
    def default_device(self) -> int:
        """The device an allocation without one goes to."""
        return self._default_device

    @property
    def slabs(self) -> SlabStats:
        """Slabs of one-granule allocations (:class:`~torpor.allocator.views.SlabStats`)."""
        return self._slabs

    @property
    def backups(self) -> BackupView:
        """Where the tags' backups lie in host memory (:class:`~torpor.allocator.views.BackupView`)."""
        return self._backups

    @property
    def native_entry(self) -> NativeEntry:
        """The native table as a C library outside torpor binds it (:class:`~torpor.allocator.views.NativeEntry`)."""
        return self._native

    # -- the raw path -------------------------------------------------------------------

    def granularity(self, device: int | None = None) -> int:
        """Mapping granularity of ``device`` (allocation sizes are rounded up to it)."""
        return self._granularity(self._default_device if device is None else device)

    def current_tag(self) -> str | None:
        """The innermost tag of :meth:`use_memory_pool` (or the graph pool) on this thread."""
        return self._book.current()

    def tag_state(self, tag: str) -> TagState:
        """Python's record of ``tag`` (its backup), made on first use."""
        return self._book.state(tag)

    def allocate(self, nbytes: int, tag: str | None = None, device: int | None = None) -> int:
        """Map ``nbytes`` (rounded up to the granularity) under ``tag``; return the address."""
        return self._raw.allocate(nbytes, tag, self._default_device if device is None else device)

    def free(self, address: int) -> None:
        """Free an allocation (its mapping goes with its last user); while its tag is released only its address range.

        Its host backup, if any, goes back at once (a free torch makes through the
        library's free returns it at the next wake or dropped backup).
        """
        self._raw.free(address)

    def size_of(self, address: int) -> int:
        """Mapped size of the allocation at ``address``."""
        return self._raw.size_of(address)

    def allocations(self, tag: str | None = None) -> list[Live]:
        """The live allocations (of ``tag``, or of all): address, size, device each, from the native table."""
        return list(self._table.allocations(tag))

    def read(self, address: int, nbytes: int) -> bytes:
        """Bytes at a device address (through the driver; tests and demos)."""
        return self._driver.read(address, nbytes)

    def write(self, address: int, data: bytes) -> None:
        """Write bytes at a device address (through the driver; tests and demos).

        At an address of a tag asleep or going to sleep: :class:`~torpor.errors.TagNotAwake` naming the tag, its state and the
        sleep (the driver's own error is its cause).
        """
        self._raw.write(address, data)

    def grow_host(self) -> None:
        """Raise the pin-ahead target to the tagged bytes (tags outside the policy's ``prepin_exclude``)."""
        self._host.want(self._book.tagged_bytes(self._host.policy.prepin_exclude))

    # -- pools ------------------------------------------------------------------------------

    def use_memory_pool(self, tag: str) -> AbstractContextManager[None]:
        """Route this thread's allocations to ``tag`` (torch tensors on CUDA; :meth:`allocate` everywhere); nested: inner wins.

        Only while ``tag`` is awake: a block of a tag that is asleep or going to sleep
        raises :class:`~torpor.errors.TagNotAwake` at its start, and a sleep of the tag
        waits for the blocks open in other threads (:meth:`close_doors`).
        """
        return self._routing.memory_pool(tag)

    def empty_cache(self, tags: Sequence[str] | None = None) -> int:
        """Give back the free cached segments of ``tags`` (None: all) that no open block uses; the bytes.

        What ``torch.cuda.empty_cache()`` does for torch's own pool, for the tags' pools (that call does this
        too once the torch side exists: ``empty_cache_hook``). Safe with kernels still queued: each segment's
        stream is waited for first (Invariant: stream-ordered trim). Without torch there is no cache: 0.
        """
        return self._routing.empty_cache(tags)

    def close_doors(self, tags: Sequence[str], cause: str, timeout: float) -> None:
        """Refuse new ``use_memory_pool`` blocks of ``tags`` and wait up to ``timeout`` s for the open ones to end.

        :class:`~torpor.errors.BlocksOpen` names the blocks still open (in another thread past the wait, or in
        this one); nothing is touched then. ``cause`` names the sleep in later refusals. The controller calls
        this before a sleep takes the book's lock (Invariant: the allocator's lock order).
        """
        self._book.close_doors(tags, cause, timeout)

    def open_doors(self, tags: Sequence[str]) -> None:
        """The sleep that closed the doors ended: blocks of ``tags`` may start wherever the tag is awake again."""
        self._book.open_doors(tags)

    def use_cudagraph_pool(self) -> AbstractContextManager[PoolId]:
        """Yield the graph pool's id for ``torch.cuda.graph(pool=...)``; allocations inside are tagged cudagraph.

        The allocator's capture observers (``capture_observers``, :meth:`on_capture`) are told the id first.
        """
        return self._routing.cudagraph_pool()

    def capture_into_pool(self, site: str) -> AbstractContextManager[CaptureHandle]:
        """Context for capturing graphs at ``site``: yields a :class:`CaptureHandle` (a pool id that records graphs)."""
        return self._routing.capture(site)

    def on_capture(self, observer: CaptureObserver) -> Callable[[], None]:
        """Call ``observer(pool_id)`` whenever a capture into this allocator's graph pool starts; returns its remover.

        A failing observer is logged and never breaks the capture. The process-wide
        NCCL hook is the integration's: ``torpor.hooks.set_nccl_graph_pool_hook``.
        """
        return self._graphs.observers.add(observer)

    def cudagraph_pool_holders(self) -> list[str]:
        """Everything that still references the graph pool (empty when it can be released)."""
        return self._graphs.holders()

    def cudagraph_pool_id(self) -> PoolId | None:
        """The current graph pool's id, None before the first capture or after a release."""
        return self._graphs.pool_id()

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool once nothing references it; return the bytes it held; the next capture starts afresh."""
        return self._graphs.release(lambda pool: self._torch.pools().drop(pool), self.free)

    # -- the memory protocol: the sleep/wake cycle, keeping around its release and restore --------

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Copy each tag to pinned host memory (copies finish before :meth:`release` unmaps); all or nothing."""
        return self._cycle.backup(tags)

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Release each tag's physical memory, per tag all or nothing; a tag without a backup keeps its sourced ranges."""
        with self._book.lock:
            saved = self._kept.save(tags)
            try:
                out = self._cycle.release(tags)
            except BaseException:
                self._kept.unsave(saved)
                raise
            return self._kept.counted(out, saved)

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Map each tag back at its addresses and copy its backup (or kept ranges) in; all or nothing, backups kept."""
        with self._book.lock:
            fresh = self._kept.to_load(tags)
            out = self._cycle.restore(tags)
            self._kept.load(fresh, tags, self._cycle.release)  # a failed copy releases the tags again
            return self._kept.counted(out, fresh)

    def drop_backup(self, tags: Sequence[str]) -> None:
        """Mark the tags' backups stale (their host extents and kept copies go); a frozen tag takes allocations again."""
        with self._book.lock:
            self._cycle.drop_backup(tags)
            self._kept.dropped(tags)

    def keep(self, tag: str, source: KeepSource) -> Callable[[], None]:
        """Keep ``source``'s ranges of ``tag`` whenever ``tag`` is released without a backup; returns its remover."""
        return self._kept.keep(tag, source)

    def track(self, module: object, tag: str = "weights", *, check: bool = True) -> KeepSource:
        """Keep what no ``state_dict`` reload restores of ``module`` (a torch module, or any :class:`KeepSource`).

        Returns the source: for a module a ``ModuleTracker``, whose ``check_reloaded()`` names each
        parameter the reload left unwritten (``check``) and whose ``untrack()`` stops keeping it.
        """
        return self._kept.track(module, tag, check=check)

    def kept_bytes(self, tag: str | None = None) -> int:
        """Host bytes kept now for released tags (of ``tag``, or of all)."""
        return self._kept.kept_bytes(tag)

    def kept_names(self, tag: str) -> list[str]:
        """What the kept copy of ``tag`` holds (the sources' names), empty when nothing is kept."""
        return self._kept.kept_names(tag)

    def usage(self) -> dict[str, TagUsage]:
        """Bytes per tag: resident, on the host, or discarded, and the number of allocations."""
        return self._book.usage()

    def pinned_bytes(self) -> int:
        """Host bytes held for backups (used or kept for reuse): pinned, or being pinned after a staged sleep."""
        return self._host.held_bytes()

    def wait_host_ready(self, timeout: float | None = None) -> bool:
        """Block until pinning ahead caught up with the tagged memory; False on timeout."""
        self.grow_host()
        return self._host.wait_ready(timeout)

    def configure_host(
        self, *, prepin: bool, limit_bytes: int | None, prepin_exclude: frozenset[str] = frozenset()
    ) -> None:
        """Apply the controller's host-memory policy to the arena (pinning ahead starts at once when asked).

        ``prepin_exclude``: tags whose growth does not pin ahead (the controller
        passes the tags its policy never backs up).
        """
        self._host.configure(prepin=prepin, limit_bytes=limit_bytes, prepin_exclude=frozenset(prepin_exclude))
        if prepin:
            self.grow_host()

    def trim_host(self, background: bool = False) -> int:
        """Unpin host chunks that hold no backup; return the bytes given back (see :meth:`HostArena.trim`)."""
        return self._host.trim(background)

    def wait_host_unpinned(self, timeout: float | None = None) -> bool:
        """Block until background trims (:meth:`trim_host`, the policy's unpin after a wake) are done; False on timeout."""
        return self._host.wait_unpinned(timeout)

    @property
    def host_provider(self) -> HostProvider | None:
        """Where host ranges reserved from now on get their memory (None: the driver's own); see :meth:`use_host_provider`."""
        return self._host.provider

    def use_host_provider(self, provider: HostProvider | None) -> None:
        """Back host ranges reserved from now on with ``provider``'s memory (a keeper's); chunks already held stay."""
        self._host.use_provider(provider)

    def device_memory(self) -> DeviceMemory:
        """Device memory in use on the devices this allocator maps, and how much of it is torpor's (mapped) tags."""
        devices = {d for _, _, d in self._table.allocations()} | {self._default_device}
        mapped = self._table.stats().mapped
        total = in_use = 0
        for device in sorted(devices):
            free, size = self._driver.mem_info(device)
            total += size
            in_use += size - free
        return DeviceMemory(total, in_use, mapped)

    def pending_errors(self) -> list[AllocatorError]:
        """Errors of torch's malloc/free calls (in the native library) since the last call, and forget them."""
        return self._table.errors()  # the native table's own mutex: no wait on a sleep or wake in another thread

    def close(self) -> None:
        """Teardown: unmap what is mapped, free reservations and pinned memory (also while asleep)."""
        self._kept.close()  # kept copies of discarded tags
        with self._book.lock:
            for record in self._book.records.values():
                self._cycle.settle(record)
            if self._torch.current is not None:
                self._graphs.detach()
                self._torch.close()  # torch frees its cached segments through the native free
            self._stager.abort()
            failed = self._table.close()
            if failed:
                logger.error("%d driver call(s) failed while tearing the allocator down", failed)
            self._host.close()
