"""TaggedAllocator: device memory in tags whose physical memory sleep releases and wake maps back at the same addresses.

Mechanism only: the controller decides which tags are backed up or discarded;
this class does what it is told, all or nothing per call (backup, restore) or
per tag (release), and rolls back its own mappings when a step fails. It meets
``torpor.statemachine.protocol.GraphPoolMemory`` and runs unchanged on
:class:`~torpor.allocator.cuda_driver.CudaDriver` and
:class:`~torpor.allocator.sim.SimDriver`.

Sleep pipeline: :meth:`backup` enqueues the copies of each batch of adjacent
mappings and records an event per batch; :meth:`release` unmaps (and releases
the handles of) each batch as soon as its copy is done, so that driver work
overlaps the copies still in flight. Wake creates and maps batch after batch,
sets access once per contiguous span, and enqueues each batch's copy at once, so
mapping overlaps the copies; it synchronizes once at the end. Copies merge over
contiguous device ranges but never cross two pinned host chunks. CUDA maps a
physical handle only whole, so each mapping has its own handle. Allocations of
one granule (torch's 2 MiB small-pool segments) share slabs
(:mod:`torpor.allocator.slabs`), so thousands of them cost a few mappings to
make and to unmap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from torpor.allocator.driver import Driver
from torpor.allocator.errors import AllocatorError, wrap
from torpor.allocator.graphpool import CaptureHandle, GraphPool, PoolId, call_graph_pool_hooks
from torpor.allocator.mapping import MappedRange, Piece, batches, copies, parts, spans, take_front
from torpor.allocator.offload import Extent, HostArena, HostPolicy
from torpor.allocator.slabs import Slabs
from torpor.allocator.va import VaArena
from torpor.errors import PoolBusy, UnknownTag
from torpor.statemachine.protocol import DeviceMemory, TagUsage, Transfer

logger = logging.getLogger("torpor.allocator")
MiB = 1 << 20
GRAPH_TAG = "cudagraph"


@dataclass(eq=False)
class _Alloc:
    address: int
    size: int
    requested: int
    tag: str
    device: int
    maps: list[MappedRange] = field(default_factory=list)
    backup: list[Extent] | None = None


@dataclass
class _Tag:
    allocs: dict[int, _Alloc] = field(default_factory=dict)
    released: bool = False
    backed_up: bool = False
    pending: list[tuple[object, list[MappedRange]]] = field(default_factory=list)

    def bytes(self) -> int:
        return sum(a.size for a in self.allocs.values())


class TaggedAllocator:
    """Tagged device memory with sleep (backup, release) and wake (restore) per tag; see the module docstring.

    ``driver``: None means :class:`~torpor.allocator.cuda_driver.CudaDriver`.
    ``host``: the pinned-host policy. ``group_bytes``: bytes per pipelined
    copy group. ``piece_bytes``: the largest single mapping made on wake.
    ``slab_bytes``: the largest slab shared by one-granule allocations (see
    :mod:`torpor.allocator.slabs`; 0 maps each allocation on its own).
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
            from torpor.allocator.cuda_driver import CudaDriver

            driver = CudaDriver()
        self.driver = driver
        self.host = HostArena(driver, host)
        self.group_bytes = group_bytes
        self.piece_bytes = piece_bytes
        self.slabs = Slabs(slab_bytes)
        self.default_device = default_device
        self._lock = threading.RLock()
        self._tags: dict[str, _Tag] = {}
        self._allocs: dict[int, _Alloc] = {}
        self._arenas: dict[tuple[int, str], VaArena] = {}
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
            gran = self.driver.granularity(dev)
            self._gran[dev] = gran
        return gran

    def current_tag(self) -> str | None:
        """The innermost tag of :meth:`use_memory_pool` (or the graph pool) on this thread."""
        stack: list[str] = getattr(self._local, "tags", [])
        return stack[-1] if stack else None

    def allocate(self, nbytes: int, tag: str | None = None, device: int | None = None) -> int:
        """Map ``nbytes`` (rounded up to the granularity) under ``tag``; return the address."""
        tag = tag or self.current_tag() or "default"
        dev = self.default_device if device is None else device
        if nbytes <= 0:
            msg = f"cannot allocate {nbytes} bytes"
            raise AllocatorError("allocate", tag, msg)
        with self._lock:
            state = self._tags.setdefault(tag, _Tag())
            if state.released:
                msg = f"tag {tag!r} is released (asleep, {len(state.allocs)} allocation(s)); wake it first"
                raise AllocatorError("allocate", tag, msg)
            gran = self.granularity(dev)
            size = -(-nbytes // gran) * gran
            arena = self._arenas.get((dev, tag))
            if arena is None:
                arena = self._arenas[(dev, tag)] = VaArena(self.driver, dev)
            slab = self.slabs.enabled(size, gran)
            spare = self.slabs.take((dev, tag), size) if slab else None
            if spare is not None:  # a granule of a live slab: mapped already
                address, m = spare
                alloc = _Alloc(address, size, nbytes, tag, dev, [m])
            else:
                span = self.slabs.next_size((dev, tag), gran) if slab else size
                try:
                    address = arena.take(span)
                except Exception as exc:
                    raise wrap("allocate", tag, exc) from exc
                alloc = _Alloc(address, size, nbytes, tag, dev)
                try:
                    alloc.maps.append(self._new_mapping(address, span, dev, 1))
                    self.driver.set_access(address, span, dev)
                except Exception as exc:
                    self._unmap_all(alloc.maps)
                    alloc.maps.clear()
                    arena.give(address, span)
                    raise wrap("allocate", tag, exc) from exc
                if slab:
                    self.slabs.add((dev, tag), alloc.maps[0], size)
            state.allocs[address] = alloc
            self._allocs[address] = alloc
            if tag not in self.host.policy.prepin_exclude:
                self.host.want(self._prepin_bytes())
            return address

    def free(self, address: int) -> None:
        """Unmap and forget an allocation; while its tag is released only its address range is freed."""
        with self._lock:
            alloc = self._allocs.get(address)
            if alloc is None:
                msg = f"{address:#x} is not an allocation of this allocator ({len(self._allocs)} live)"
                raise AllocatorError("free", None, msg)
            state = self._tags[alloc.tag]
            self._wait_pending(state, alloc)
            arena = self._arenas[(alloc.device, alloc.tag)]
            try:
                for m in list(alloc.maps):
                    lo, hi = max(alloc.address, m.start), min(alloc.address + alloc.size, m.end)
                    if m.users <= 1 and m.handle is not None:
                        self._unmap(m)
                        for start, n in [*m.freed, (lo, hi - lo)]:
                            arena.give(start, n)
                        m.freed.clear()
                        self.slabs.forget((alloc.device, alloc.tag), m)
                    else:
                        m.freed.append((lo, hi - lo))  # mapped with live neighbours: goes with the mapping
                    m.users -= 1
                    alloc.maps.remove(m)
            except Exception as exc:
                raise wrap("free", alloc.tag, exc) from exc
            del self._allocs[address]
            del state.allocs[address]
            if alloc.backup:
                self.host.give(alloc.backup)
                alloc.backup = None
            if state.released:  # nothing mapped: only the address range goes
                arena.give(alloc.address, alloc.size)

    def size_of(self, address: int) -> int:
        """Mapped size of the allocation at ``address``."""
        with self._lock:
            return self._allocs[address].size

    def read(self, address: int, nbytes: int) -> bytes:
        """Bytes at a device address (through the driver; tests and demos)."""
        return self.driver.read(address, nbytes)

    def write(self, address: int, data: bytes) -> None:
        """Write bytes at a device address (through the driver; tests and demos)."""
        self.driver.write(address, data)

    # -- pools ------------------------------------------------------------------------------

    @contextmanager
    def use_memory_pool(self, tag: str) -> Iterator[None]:
        """Route this thread's allocations to ``tag`` (torch tensors on CUDA; :meth:`allocate` everywhere); nested: inner wins."""
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
            state = self._tags.get(GRAPH_TAG)
            if state is not None and state.released:
                msg = (
                    f"cudagraph pool {pool.id} is asleep ({state.bytes()} bytes released): "
                    "freeing it would unmap a second time; wake first"
                )
                raise PoolBusy(msg)
            holders = pool.holders()
            if holders:
                msg = f"cudagraph pool is referenced by {len(holders)} holder(s) ({'; '.join(holders)}); release the graphs first"
                raise PoolBusy(msg, holders)
            before = state.bytes() if state is not None else 0
            self._graph_pool = None
            if pool.mempool is not None:
                self._torch_pools().drop(pool)  # torch frees the segments through the free callback
                left = state.bytes() if state is not None else 0
                if left:
                    logger.warning(
                        "%d bytes of the released graph pool are still allocated (tensors of it alive)", left
                    )
            elif state is not None:
                for address in list(state.allocs):
                    self.free(address)
            return before - (state.bytes() if state is not None else 0)

    def _ensure_graph_pool(self) -> GraphPool:
        with self._lock:
            state = self._tags.get(GRAPH_TAG)
            if state is not None and state.released:
                msg = f"cannot capture: the cudagraph pool is released (asleep, {state.bytes()} bytes on host); wake first"
                raise AllocatorError("capture", GRAPH_TAG, msg)
            self._tags.setdefault(GRAPH_TAG, _Tag())
            if self._graph_pool is None:
                self._pool_generation += 1
                if self._on_cuda():
                    self._graph_pool = self._torch_pools().new_graph_pool()
                else:
                    self._graph_pool = GraphPool((-1, self._pool_generation))
            return self._graph_pool

    # -- the memory protocol ---------------------------------------------------------------

    def usage(self) -> dict[str, TagUsage]:
        """Bytes per tag: resident, on the host, or discarded, and the number of allocations."""
        with self._lock:
            out = {}
            for tag, state in self._tags.items():
                n = state.bytes()
                count = len(state.allocs)
                if not state.released:
                    out[tag] = TagUsage(n, 0, 0, count)
                elif state.backed_up:
                    out[tag] = TagUsage(0, n, 0, count)
                else:
                    out[tag] = TagUsage(0, 0, n, count)
            return out

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Copy each tag to pinned host memory (copies finish before :meth:`release` unmaps); all or nothing."""
        with self._lock:
            self._check_known("backup", tags)
            start = time.perf_counter()
            states = [(t, self._tags[t]) for t in tags]
            for tag, state in states:
                if state.released:
                    msg = f"tag {tag!r} is released; nothing resident to back up"
                    raise AllocatorError("backup", tag, msg)
            for device in self._devices(tags):
                try:
                    self.driver.synchronize(device)
                except Exception as exc:
                    raise wrap("backup", None, exc) from exc
            taken: list[_Tag] = []
            try:
                for tag, state in states:
                    self._drop(state)
                    self._take_host(tag, state)
                    taken.append(state)
                for tag, state in states:
                    self._enqueue_backup(tag, state)
            except BaseException:  # an error or an interrupt (Ctrl-C): no backup stays half made
                for state in taken:
                    self._drop(state)
                raise
            seconds = time.perf_counter() - start
            return {t: Transfer(t, s.bytes(), seconds, True) for t, s in states}

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Release each tag's physical memory; per tag all or nothing (a failed tag stays resident)."""
        with self._lock:
            self._check_known("release", tags)
            if not any(self._tags[t].pending for t in tags):
                for device in self._devices(tags):
                    try:
                        self.driver.synchronize(device)
                    except Exception as exc:
                        raise wrap("release", None, exc) from exc
            out = {}
            for tag in tags:
                start = time.perf_counter()
                state = self._tags[tag]
                if state.released:
                    out[tag] = Transfer(tag, 0, 0.0, state.backed_up)
                    continue
                self._release_tag(tag, state)
                out[tag] = Transfer(tag, state.bytes(), time.perf_counter() - start, state.backed_up)
            return out

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Map each tag back at its addresses and copy its backup in; all or nothing, backups kept."""
        with self._lock:
            self._check_known("restore", tags)
            start = time.perf_counter()
            todo = [(t, self._tags[t]) for t in tags if self._tags[t].released]
            allocs = [a for _, s in todo for a in sorted(s.allocs.values(), key=lambda a: a.address)]
            current = ""
            try:
                for tag, state in todo:
                    current = tag
                    self._remap(sorted(state.allocs.values(), key=lambda a: a.address), state.backed_up)
                for device in {a.device for a in allocs}:
                    self.driver.wait(self.driver.record(device))
            except BaseException as exc:  # an error or an interrupt (Ctrl-C): unmap what this restore mapped
                self._rollback_restore(allocs)
                logger.warning("Rolling back %d mapped allocation(s) after a failed wake", len(allocs))
                if not isinstance(exc, Exception):
                    raise
                raise wrap("restore", current or None, exc) from exc
            seconds = time.perf_counter() - start
            out = {t: Transfer(t, 0, 0.0, self._tags[t].backed_up) for t in tags}
            for tag, state in todo:
                state.released = False
                out[tag] = Transfer(tag, state.bytes(), seconds, state.backed_up)
            return out

    def drop_backup(self, tags: Sequence[str]) -> None:
        """Mark the tags' backups stale (host extents return to the arena; chunks stay pinned per the host policy)."""
        with self._lock:
            for tag in tags:
                state = self._tags.get(tag)
                if state is not None:
                    self._drop(state)

    def pinned_bytes(self) -> int:
        """Pinned host bytes held for backups (used or kept for reuse)."""
        return self.host.pinned_bytes()

    def wait_host_ready(self, timeout: float | None = None) -> bool:
        """Block until pinning ahead caught up with the tagged memory; False on timeout."""
        return self.host.wait_ready(timeout)

    def configure_host(self, *, prepin: bool, limit_bytes: int | None) -> None:
        """Apply the controller's host-memory policy to the arena (pinning ahead starts at once when asked)."""
        self.host.configure(prepin=prepin, limit_bytes=limit_bytes)
        if prepin:
            with self._lock:
                self.host.want(self._prepin_bytes())

    def trim_host(self, background: bool = False) -> int:
        """Unpin host chunks that hold no backup; return the bytes given back (see :meth:`HostArena.trim`)."""
        return self.host.trim(background)

    def device_memory(self) -> DeviceMemory:
        """Device memory in use on the devices this allocator maps, and how much of it is torpor's (mapped) tags."""
        with self._lock:
            devices = {a.device for a in self._allocs.values()} | {self.default_device}
            mapped = {id(m): m.size for a in self._allocs.values() for m in a.maps if m.handle is not None}
        total = in_use = 0
        for device in sorted(devices):
            free, size = self.driver.mem_info(device)
            total += size
            in_use += size - free
        return DeviceMemory(total, in_use, sum(mapped.values()))

    def pending_errors(self) -> list[AllocatorError]:
        """Errors raised inside torch's allocation callbacks since the last call (and forget them)."""
        with self._lock:
            errors, self._callback_errors = self._callback_errors, []
            return errors

    def close(self) -> None:
        """Teardown: unmap what is mapped, free reservations and pinned memory (also while asleep)."""
        with self._lock:
            for state in self._tags.values():
                self._settle(state)
            if self._torch is not None:
                self._graph_pool = None
                self._torch.close()  # torch frees its cached segments through the free callback
            for address in list(self._allocs):
                try:
                    self.free(address)
                except AllocatorError:
                    logger.exception("freeing %#x at teardown failed", address)
            for arena in self._arenas.values():
                try:
                    arena.close()
                except Exception:  # teardown continues
                    logger.exception("freeing an address reservation at teardown failed")
            self._arenas.clear()
            self.host.close()
            self.closed = True

    # -- internals ----------------------------------------------------------------------------

    def _on_cuda(self) -> bool:
        return getattr(self.driver, "name", "") == "cuda"

    def _torch_pools(self) -> Any:
        if self._torch is None:
            from torpor.allocator.callbacks import TorchPools

            self._torch = TorchPools(self)
        return self._torch

    def _record_callback_error(self, error: AllocatorError) -> None:
        with self._lock:
            self._callback_errors.append(error)
            del self._callback_errors[:-16]

    def _check_known(self, operation: str, tags: Sequence[str]) -> None:
        unknown = [t for t in tags if t not in self._tags]
        if unknown:
            raise UnknownTag(unknown, self._tags)

    def _devices(self, tags: Sequence[str]) -> set[int]:
        return {a.device for t in tags for a in self._tags[t].allocs.values()}

    def _prepin_bytes(self) -> int:
        skip = self.host.policy.prepin_exclude
        return sum(s.bytes() for t, s in self._tags.items() if t not in skip)

    def _take_host(self, tag: str, state: _Tag) -> None:
        allocs = sorted(state.allocs.values(), key=lambda a: a.address)
        total = sum(a.size for a in allocs)
        try:
            extents = self.host.take(total) if total else []
        except AllocatorError as exc:
            raise wrap("backup", tag, exc) from exc
        rest = deque(extents)
        for alloc in allocs:
            alloc.backup = take_front(rest, alloc.size)
        state.backed_up = True

    def _enqueue_backup(self, tag: str, state: _Tag) -> None:
        try:
            for batch in batches(parts(state.allocs.values()), self.group_bytes):
                pieces = [p for _, ps in batch for p in ps]
                for device, address, host, n in copies(pieces):
                    self.host.wait_pinned(host)  # a first sleep pins as it copies: chunk by chunk
                    self.driver.copy_d2h(host, address, n, device)
                state.pending.append((self.driver.record(batch[0][0].device), [m for m, _ in batch]))
        except BaseException as exc:
            self._settle(state)
            if not isinstance(exc, Exception):  # an interrupt stays an interrupt
                raise
            raise wrap("backup", tag, exc) from exc

    def _settle(self, state: _Tag) -> None:
        """Wait for the tag's copies in flight, ignoring their errors (used before throwing a backup away)."""
        for event, _ in state.pending:
            try:
                self.driver.wait(event)
            except Exception:  # the backup is being dropped anyway
                logger.debug("a copy failed while its backup was being dropped", exc_info=True)
        state.pending.clear()

    def _wait_pending(self, state: _Tag, alloc: _Alloc) -> None:
        mine = {id(m) for m in alloc.maps}
        for i, (_event, batch) in enumerate(state.pending):
            if any(id(m) in mine for m in batch):
                for ev, _ in state.pending[: i + 1]:
                    self.driver.wait(ev)
                del state.pending[: i + 1]
                return

    def _drop(self, state: _Tag) -> None:
        self._settle(state)
        extents: list[Extent] = []
        for alloc in state.allocs.values():
            extents += alloc.backup or ()
            alloc.backup = None
        if extents:  # one give: with keep_after_wake off each give trims, and a tag has thousands of allocations
            self.host.give(extents)
        state.backed_up = False

    def _release_tag(self, tag: str, state: _Tag) -> None:
        allocs = sorted(state.allocs.values(), key=lambda a: a.address)
        if state.backed_up:
            missing = [a for a in allocs if a.backup is None]
            if missing:
                msg = f"{len(missing)} allocation(s) of tag {tag!r} were made after its backup; back it up again"
                raise AllocatorError("release", tag, msg)
        entries = parts(allocs)
        live = {id(m) for m, _ in entries}
        order: list[tuple[object | None, list[MappedRange]]] = []
        covered: set[int] = set()
        for event, maps in state.pending:
            keep = [m for m in maps if id(m) in live and m.handle is not None]
            order.append((event, keep))
            covered.update(id(m) for m in keep)
        rest = [e for e in entries if id(e[0]) not in covered]
        order += [(None, [m for m, _ in b]) for b in batches(rest, self.group_bytes)]
        done: list[MappedRange] = []
        try:
            for event, maps in order:
                if event is not None:
                    self.driver.wait(event)
                for m in maps:
                    try:
                        self._unmap(m)
                    finally:  # unmapped even if releasing its handle was interrupted: map it back too
                        if m.handle is None:
                            done.append(m)
        except BaseException as exc:  # an error or an interrupt (Ctrl-C): the tag stays resident
            self._settle(state)
            lost = self._map_back(done, dict((id(m), ps) for m, ps in entries), state.backed_up)
            if not isinstance(exc, Exception):
                raise
            detail = f"; {lost} bytes mapped back fresh (no backup)" if lost else ""
            error = wrap("release", tag, exc)
            error.reason += f" (tag left resident{detail})"
            error.args = (f"{error.args[0]} (tag left resident{detail})",)
            raise error from exc
        state.pending.clear()
        for alloc in allocs:
            alloc.maps.clear()
        for m in done:
            for start, n in m.freed:  # ranges no live allocation uses (freed ones, a slab's spare granules)
                self._arenas[(m.device, tag)].give(start, n)
            m.freed.clear()
        for device in {m.device for m in done}:
            self.slabs.close((device, tag))
        state.released = True

    def _new_mapping(self, start: int, size: int, device: int, users: int) -> MappedRange:
        """Create a handle of ``size`` and map it at ``start``."""
        handle = self.driver.create(size, device)
        try:
            self.driver.map(start, size, handle)
        except BaseException:
            self.driver.release(handle)
            raise
        return MappedRange(start, size, handle, device, users)

    def _unmap(self, m: MappedRange) -> None:
        """Unmap a mapping, then release its handle (a failed release only leaks the handle)."""
        self.driver.unmap(m.start, m.size)
        handle, m.handle = m.handle, None
        try:
            self.driver.release(handle)
        except Exception:  # the range is unmapped and its data safe; report the leak
            logger.exception("releasing the physical handle of %#x+%d failed; it leaks", m.start, m.size)

    def _unmap_all(self, maps: list[MappedRange]) -> None:
        """Unmap every still-mapped mapping, logging failures (rollback paths)."""
        for m in maps:
            if m.handle is None:
                continue
            try:
                self._unmap(m)
            except Exception:  # rollback continues; the range stays mapped
                logger.exception("rollback: unmapping %#x+%d failed", m.start, m.size)

    def _pieces(self, alloc: _Alloc) -> list[tuple[int, int]]:
        step = max(self.piece_bytes // self.granularity(alloc.device), 1) * self.granularity(alloc.device)
        return [(alloc.address + off, min(step, alloc.size - off)) for off in range(0, alloc.size, step)]

    def _remap(self, allocs: list[_Alloc], with_backup: bool) -> None:
        """Map ``allocs`` span by span (adjacent allocations share one handle), each span's copy enqueued at once."""
        leftovers = {id(m): m for alloc in allocs for m in alloc.maps if m.handle is not None}
        for m in leftovers.values():  # left mapped by a rollback that could not unmap: unmap before mapping anew
            self._unmap(m)
        for alloc in allocs:
            alloc.maps.clear()
        pieces: list[Piece] = [(a, start, n) for a in allocs for start, n in self._pieces(a)]
        for span in spans(pieces, self.group_bytes):
            start, device = span[0][1], span[0][0].device
            size = sum(n for _, _, n in span)
            users: list[_Alloc] = []
            for a, _, _ in span:
                if not users or users[-1] is not a:
                    users.append(a)  # type: ignore[arg-type]
            m = self._new_mapping(start, size, device, len(users))
            for a in users:
                a.maps.append(m)
            self.driver.set_access(start, size, device)
            if with_backup:
                for dev, address, host, n in copies(span):
                    self.driver.copy_h2d(address, host, n, dev)

    def _rollback_restore(self, allocs: list[_Alloc]) -> None:
        for device in {a.device for a in allocs}:
            try:
                self.driver.synchronize(device)
            except Exception:  # the wake failed already; unmap what we can
                logger.exception("synchronizing before rolling back a wake failed")
        self._unmap_all([e[0] for e in parts(allocs)])
        for alloc in allocs:  # a mapping that would not unmap stays listed; the next wake unmaps it first
            alloc.maps[:] = [m for m in alloc.maps if m.handle is not None]

    def _map_back(self, done: list[MappedRange], pieces: dict[int, list[Piece]], with_backup: bool) -> int:
        """Map back what a failed release unmapped (from the backup); return the bytes that came back fresh."""
        lost = 0
        for m in done:
            try:
                fresh = self._new_mapping(m.start, m.size, m.device, m.users)
                m.handle = fresh.handle
                self.driver.set_access(m.start, m.size, m.device)
                if with_backup:
                    for dev, address, host, n in copies(pieces.get(id(m), [])):
                        self.driver.copy_h2d(address, host, n, dev)
                else:
                    lost += m.size
            except Exception:  # cannot do more: the range stays unmapped and the error above is raised
                logger.exception("rollback: mapping %#x+%d back failed", m.start, m.size)
        for device in {m.device for m in done}:
            try:
                self.driver.wait(self.driver.record(device))
            except Exception:
                logger.exception("rollback: waiting for copies back failed")
        return lost


def capture_context(allocator: TaggedAllocator, site: str) -> AbstractContextManager[CaptureHandle]:
    """Same as ``allocator.capture_into_pool(site)`` (a function form for integrations)."""
    return allocator.capture_into_pool(site)


def usage_total(usage: Mapping[str, TagUsage]) -> int:
    """Resident + host + discarded bytes over all tags."""
    return sum(u.resident + u.host + u.discarded for u in usage.values())
