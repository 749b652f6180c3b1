"""Pinned-host backup memory: chunks pinned as a sleep copies into them (or ahead of it), reused across cycles.

Pinning costs more than copying (H200 host: 8 GiB of 4 KiB pages faulted in
from one thread in 3.96 s, copied in 0.156 s), so a backup's
:meth:`~HostArena.take` reserves what is missing as one range (huge pages
advised) cut into chunks that threads fault in and register in address order,
and the backup waits for each chunk (:meth:`~HostArena.wait_pinned`) just before
copying into it: pinning chunk *n + 1* overlaps the copy into chunk *n*. Pinning
ahead (:meth:`~HostArena.want`, one background thread) stays available.

A range stays reserved or pinned while any record refers to it (a chunk whose
pin failed stays, failed, until its extents come back), so addresses key chunks
safely although mmap reuses a range given back (docs/allocator.md).

Mechanism only: whether to pin ahead, whether to keep chunks after a wake, and
the byte limit come from the controller's host-memory policy
(``torpor.statemachine.policy.HostMemoryPolicy``) through :meth:`HostArena.configure`.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from torpor.allocator.driver import Driver
from torpor.allocator.errors import AllocatorError, AllocatorOutOfMemory
from torpor.allocator.hostchunk import Chunk, Extent, HostPolicy, carve, closed_error, new_chunks, pin_error

__all__ = ["Extent", "HostArena", "HostPolicy"]

logger = logging.getLogger("torpor.allocator")


class HostArena:
    """Pinned host chunks for backups: pinned while a sleep copies, or ahead in a background thread."""

    def __init__(self, driver: Driver, policy: HostPolicy | None = None) -> None:
        self.driver = driver
        self.policy = policy or HostPolicy()
        self._chunks: dict[int, Chunk] = {}
        self._bases: list[int] = []  # sorted chunk addresses, for wait_pinned
        self._pinned = 0  # bytes of registered chunks
        self._pending = 0  # bytes of chunks reserved, not yet registered
        self._pinning = 0  # pins in progress (pause waits for them)
        self._unpinning = 0  # bytes a background trim is still unpinning
        self._cond = threading.Condition()
        self._target = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._paused = 0
        self.last_error: BaseException | None = None
        self.pin_seconds = 0.0

    def configure(self, **changes: object) -> HostPolicy:
        """Change policy fields (``prepin``, ``keep_after_wake``, ``limit_bytes``, ...); return the new policy."""
        with self._cond:
            self.policy = dataclasses.replace(self.policy, **changes)  # type: ignore[arg-type]
            if not self.policy.prepin:
                self._target = 0
            self._cond.notify_all()
            return self.policy

    # -- reading ---------------------------------------------------------------------

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory held (registered chunks)."""
        with self._cond:
            return self._pinned

    def used_bytes(self) -> int:
        """Bytes of pinned host memory holding backups."""
        with self._cond:
            return sum(c.used() for c in self._chunks.values() if c.error is None)

    def free_bytes(self) -> int:
        """Pinned (or being pinned) bytes not holding a backup."""
        with self._cond:
            return self._free_locked()

    def _free_locked(self) -> int:
        return sum(n for c in self._chunks.values() if c.error is None for _, n in c.free)

    # -- chunks ------------------------------------------------------------------------

    def _add_locked(self, host: int, nbytes: int) -> Chunk:
        c = Chunk(host, nbytes)
        self._chunks[host] = c
        bisect.insort(self._bases, host)
        self._pending += nbytes
        return c

    def _remove_locked(self, c: Chunk) -> bool:
        """Take ``c`` out of the records (before its range is unpinned or unreserved); False if it is not there."""
        if self._chunks.get(c.host) is not c:
            return False
        del self._chunks[c.host]
        self._bases.remove(c.host)
        return True

    def _reserve(self, sizes: list[int], wanted: int = 0) -> tuple[list[Chunk], list[Extent]]:
        """Reserve chunks of ``sizes`` as one range of address space (not yet pinned); carve ``wanted`` bytes from them."""
        base = self.driver.host_reserve(sum(sizes))
        out = []
        with self._cond:
            if not self._closed:
                offset = 0
                for n in sizes:
                    out.append(self._add_locked(base + offset, n))
                    offset += n
                return out, carve(out, wanted)
        # closed meanwhile: no record would ever give this range back
        self._unreserve(Chunk(base, sum(sizes)))
        raise closed_error("take")

    def _pin_chunk(self, c: Chunk) -> None:
        """Fault in and register one reserved chunk (any thread); failures are kept on the chunk.

        A pin counts in ``_pinning`` until all it does with the range is done, so
        :meth:`close` leaves no thread touching host memory; a pin still queued at
        close does nothing (``close`` gave its range back).
        """
        with self._cond:
            if self._closed or self._chunks.get(c.host) is not c:  # close took it (a pending chunk is only closed away)
                return
            self._pinning += 1
        try:
            self._pin_held(c)
        finally:
            with self._cond:
                self._pinning -= 1
                self._cond.notify_all()

    def _pin_held(self, c: Chunk) -> None:
        start = time.perf_counter()
        try:
            self.driver.prepare_thread()
            self.driver.host_alloc(c.nbytes, c.host)
        except Exception as exc:  # kept on the chunk: the copy that needs it raises it
            with self._cond:
                c.error = exc
                held = self._chunks.get(c.host) is c
                if held:
                    self._pending -= c.nbytes
                # extents of it are out: it keeps its range (and address) until they come back (give)
                gone = not held or (c.used() == 0 and self._remove_locked(c))
                self._cond.notify_all()
            if gone:
                self._unreserve(c)
            return
        with self._cond:
            self.pin_seconds += time.perf_counter() - start
            closed = self._closed or self._chunks.get(c.host) is not c
            if not closed:
                c.ready = True
                self._pending -= c.nbytes
                self._pinned += c.nbytes
            self._cond.notify_all()
        if closed:
            self._free(c)

    def _unreserve(self, c: Chunk) -> None:
        try:
            self.driver.host_unreserve(c.host, c.nbytes)
        except Exception:  # only address space leaks
            logger.exception("giving back %d reserved host bytes at %#x failed", c.nbytes, c.host)

    def _free(self, c: Chunk) -> None:
        try:
            self.driver.host_free(c.host)
        except Exception:  # an unpin that fails only leaks host memory; log it
            logger.exception("unpinning %d host bytes at %#x failed", c.nbytes, c.host)

    # -- pinning ahead ----------------------------------------------------------------

    def want(self, nbytes: int) -> None:
        """Have at least ``nbytes`` pinned soon (background; never blocks the caller; up to the limit)."""
        if not self.policy.prepin:
            return
        with self._cond:
            limit = self.policy.limit_bytes
            nbytes = nbytes if limit is None else min(nbytes, limit)
            if nbytes <= self._target or self._closed:
                return
            self._target = nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._pinner, name="torpor-host-pinner", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until pinning ahead reached its target and no chunk is pending; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: (
                    self._closed or self.last_error is not None or (self._pending == 0 and self._pinned >= self._target)
                ),
                timeout,
            )

    def pause(self) -> None:
        """Hold background pinning (and wait for pins in flight): a graph capture is about to start."""
        with self._cond:
            self._paused += 1
            self._cond.wait_for(lambda: self._pinning == 0, timeout=60)

    def resume(self) -> None:
        """Let background pinning go on after :meth:`pause`."""
        with self._cond:
            self._paused = max(self._paused - 1, 0)
            self._cond.notify_all()

    def _pinner(self) -> None:
        try:
            self.driver.prepare_thread()
        except Exception as exc:  # no pinning ahead; backups pin when they need to
            logger.warning("the host pinning thread could not start: %s", exc)
            with self._cond:
                self.last_error = exc
                self._cond.notify_all()
            return
        while True:
            chunk = self.policy.chunk_bytes
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._closed
                        or (
                            self.last_error is None and not self._paused and self._pinned + self._pending < self._target
                        )
                    )
                )
                if self._closed:
                    return
                limit = self.policy.limit_bytes
                if limit is not None and self._pinned + self._pending + self._unpinning + chunk > limit:
                    self._target = self._pinned + self._pending  # the limit is reached: pin no more ahead
                    self._cond.notify_all()
                    continue
            failed: BaseException | None
            try:
                reserved, _ = self._reserve([chunk])
            except Exception as exc:
                failed = exc
            else:
                self._pin_chunk(reserved[0])
                failed = reserved[0].error
            if failed is not None and self._closed:  # closed while reserving: nothing to report
                return
            if failed is not None:
                logger.warning("pinning host memory ahead of sleep failed: %s", failed)
                with self._cond:
                    self.last_error = failed
                    self._cond.notify_all()

    # -- taking and giving ---------------------------------------------------------------

    def take(self, nbytes: int) -> list[Extent]:
        """Extents totalling ``nbytes``; what is missing is reserved now and pinned by threads as copies go.

        Call :meth:`wait_pinned` for an extent's address before copying into it.
        Raises :class:`AllocatorOutOfMemory` (nothing taken, nothing pinned) when
        the pinned bytes would pass ``limit_bytes``, or when no range can be reserved.
        """
        with self._cond:
            if self._closed:
                raise closed_error("take")
            free = self._free_locked()
            sizes = new_chunks(nbytes - free, self.policy.chunk_bytes)
            limit = self.policy.limit_bytes
            held = self._pinned + self._pending + self._unpinning
            if sizes and limit is not None and held + sum(sizes) > limit:
                used = sum(c.used() for c in self._chunks.values())
                reason = (
                    f"a backup of {nbytes} bytes needs {sum(sizes)} more pinned host bytes; the host limit is "
                    f"{limit} bytes and {held} are pinned ({used} holding backups)"
                )
                raise AllocatorOutOfMemory("pin host memory", None, reason, call="host_alloc")
            # carved now: a pending chunk counted free may fail before the lock is taken again
            extents = carve([self._chunks[b] for b in self._bases], min(free, nbytes))
        fresh: list[Chunk] = []
        if sizes:
            try:
                fresh, more = self._reserve(sizes, nbytes - sum(e.nbytes for e in extents))
            except AllocatorError:  # closed meanwhile
                self.give(extents)
                raise
            except Exception as exc:
                self.give(extents)
                raise pin_error(exc, sum(sizes), self.pinned_bytes()) from exc
            extents += more
        if fresh:
            workers = max(1, min(len(fresh), self.policy.threads))
            pool = ThreadPoolExecutor(workers, thread_name_prefix="torpor-host-pin")
            for c in fresh:  # in address order: the copies wait for chunks in that order
                pool.submit(self._pin_chunk, c)
            pool.shutdown(wait=False)
        return extents

    def wait_pinned(self, host: int) -> None:
        """Block until the chunk holding ``host`` is registered; raise the allocator error if pinning it failed."""
        with self._cond:
            i = bisect.bisect_right(self._bases, host) - 1
            c = self._chunks.get(self._bases[i]) if i >= 0 else None
            if c is None or host >= c.host + c.nbytes:
                msg = f"host address {host:#x} is in no chunk of the arena ({len(self._chunks)} chunks)"
                raise AllocatorError("pin host memory", None, msg)
            if c.ready:
                return
            chunk = c
            self._cond.wait_for(lambda: chunk.ready or chunk.error is not None or self._closed)
            if c.error is not None:
                raise pin_error(c.error, c.nbytes, self._pinned)
            if not c.ready:
                msg = "the host arena was closed while a backup waited for pinned memory"
                raise AllocatorError("pin host memory", None, msg)

    def give(self, extents: Iterable[Extent]) -> None:
        """Return extents; with ``keep_after_wake`` off, chunks left empty are unpinned; failed chunks left empty go.

        All or nothing: an extent outside its chunk or given back twice raises
        :class:`AllocatorError`; extents of chunks no longer held (closed) are ignored.
        """
        failed = []
        with self._cond:
            staged: dict[int, list[tuple[int, int]]] = {}
            for e in extents:
                c = self._chunks.get(e.chunk)
                if c is not None:
                    staged[c.host] = c.given(e.host - c.host, e.nbytes, staged.get(c.host, c.free))
            for host, free in staged.items():
                c = self._chunks[host]
                c.free = free
                if c.error is not None and c.used() == 0 and self._remove_locked(c):
                    failed.append(c)
            self._cond.notify_all()
        for c in failed:  # out of every record now: the address may be reused
            self._unreserve(c)
        if not self.policy.keep_after_wake:
            self.trim()

    def trim(self, background: bool = False) -> int:
        """Unpin every registered chunk that holds no backup; return the bytes given back.

        ``background``: unpin in a daemon thread. The chunks leave
        :meth:`pinned_bytes` at once and count against ``limit_bytes`` until
        each is unpinned.
        """
        with self._cond:
            empty = [c for c in self._chunks.values() if c.ready and c.used() == 0]
            for c in empty:
                self._remove_locked(c)
            total = sum(c.nbytes for c in empty)
            self._pinned -= total
            self._unpinning += total
            self._target = min(self._target, self._pinned)

        def unpin() -> None:
            for c in empty:
                self._free(c)
                with self._cond:
                    self._unpinning -= c.nbytes
                    self._cond.notify_all()

        if background and empty:
            threading.Thread(target=unpin, name="torpor-host-unpin", daemon=True).start()
        else:
            unpin()
        return total

    def wait_unpinned(self, timeout: float | None = None) -> bool:
        """Block until background trims are done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unpinning == 0, timeout)

    def close(self) -> None:
        """Stop the pinner, wait for pins in flight, and unpin every chunk (backups are lost).

        Ranges of pins still queued on a take's threads are unreserved here (those
        pins then do nothing); a later :meth:`take` is refused.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._pinning == 0 and self._unpinning == 0, timeout=60)
            chunks = [c for c in self._chunks.values() if c.ready]
            failed = [c for c in self._chunks.values() if c.error is not None or not c.ready]
            self._chunks.clear()
            self._bases.clear()
            self._pinned = self._pending = 0
        if self._thread is not None:
            self._thread.join(timeout=30)
        for c in chunks:
            self._free(c)
        for c in failed:
            self._unreserve(c)
