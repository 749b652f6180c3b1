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
(``torpor.statemachine.core.policy.HostMemoryPolicy``) through :meth:`HostArena.configure`.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from torpor.allocator.host.chunks import (
    Chunk,
    Extent,
    HostPolicy,
    carve,
    closed_error,
    new_chunks,
    pin_error,
    thread_died,
)
from torpor.allocator.host.pinning import PinnedChunks
from torpor.errors import AllocatorError, AllocatorOutOfMemory

__all__ = ["Extent", "HostArena", "HostPolicy"]

logger = logging.getLogger("torpor.allocator")


class HostArena(PinnedChunks):
    """Pinned host chunks for backups: pinned while a sleep copies, or ahead in a background thread."""

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
        except BaseException as exc:  # no pinning ahead; backups pin when they need to
            logger.warning("the host pinning thread could not start: %r", exc)
            with self._cond:
                self.last_error = exc if isinstance(exc, Exception) else thread_died("pin ahead", exc)
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
                if limit is not None and self._held_locked() + chunk > limit:
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

    def take(self, nbytes: int, stage: bool = False) -> list[Extent]:
        """Extents totalling ``nbytes``; what is missing is reserved now and pinned by threads as copies go.

        Call :meth:`wait_pinned` for an extent's address before copying into it.
        ``stage`` (and ``policy.staged``): the missing chunks are not pinned now;
        a staged sleep fills them (:meth:`wait_pinned` says False) and
        :meth:`end_staging` pins them; the ring it copies through counts against
        the limit (over it, or without clear room on the host for writing
        pageable pages, the chunks are pinned as usual). Raises
        :class:`AllocatorOutOfMemory` (nothing taken, nothing pinned) when the
        pinned bytes would pass ``limit_bytes``, or when no range can be reserved.
        """
        with self._cond:
            if self._closed:
                raise closed_error("take")
            free = self._free_locked()
            sizes = new_chunks(nbytes - free, self.policy.chunk_bytes)
            limit = self.policy.limit_bytes
            held = self._held_locked()
            if sizes and limit is not None and held + sum(sizes) > limit:
                used = sum(c.used() for c in self._chunks.values())
                reason = (
                    f"a backup of {nbytes} bytes needs {sum(sizes)} more pinned host bytes; the host limit is "
                    f"{limit} bytes and {held} are pinned ({used} holding backups)"
                )
                raise AllocatorOutOfMemory("pin host memory", None, reason, call="host_alloc")
            ring = self._ring_for(sum(sizes)) if stage and sizes and self.policy.staged else 0
            if ring and limit is not None and held + sum(sizes) + max(ring - self._staging, 0) > limit:
                ring = 0  # no room for the ring under the limit: pin the chunks
            # the ring counts here as well as when its slots are faulted (each claims its own bytes): the
            # chunks must fit beside it, and a second claim within the reading's few milliseconds only errs safe
            if ring and not self.driver.host_room(sum(sizes) + ring):
                ring = 0  # filling pageable pages could call the OOM killer; pinning fails cleanly
            self._staging = max(self._staging, ring)
            # carved now: a pending chunk counted free may fail before the lock is taken again
            extents = carve([self._chunks[b] for b in self._bases], min(free, nbytes))
        fresh: list[Chunk] = []
        if sizes:
            try:
                fresh, more = self._reserve(sizes, nbytes - sum(e.nbytes for e in extents), staged=bool(ring))
            except AllocatorError:  # closed meanwhile
                self.give(extents)
                raise
            except Exception as exc:
                self.give(extents)
                raise pin_error(exc, sum(sizes), self.pinned_bytes()) from exc
            extents += more
        if fresh and not ring:
            self._pin_in_threads(fresh)
        return extents

    def _ring_for(self, nbytes: int) -> int:
        slot = self.policy.stage_slot_bytes
        return min(max(self.policy.stage_ring_bytes // slot, 1), -(-nbytes // slot)) * slot

    def _pin_in_threads(self, chunks: list[Chunk], background: bool = False) -> None:
        workers = max(1, min(len(chunks), self.policy.threads))
        pool = ThreadPoolExecutor(workers, thread_name_prefix="torpor-host-pin")
        for c in chunks:  # in address order: the copies wait for chunks in that order
            pool.submit(self._pin_chunk, c, background)
        pool.shutdown(wait=False)

    def staging_bytes(self) -> int:
        """Bytes of the pinned ring the current staged sleep may use (0: no staged sleep)."""
        with self._cond:
            return self._staging

    def end_staging(self) -> None:
        """A staged sleep's copies are done (or abandoned): pin the chunks that hold them, in the background.

        Staged chunks that hold nothing (a failed sleep gave its extents back)
        are given back instead; the ring's bytes stop counting.
        """
        with self._cond:
            staged = [c for c in self._chunks.values() if c.staged]
            empty = [c for c in staged if c.used() == 0 and self._remove_locked(c)]
            for c in staged:
                c.staged = False
                c.filled = c.used() > 0
            for c in empty:
                self._pending -= c.nbytes
            kept = [c for c in staged if c.filled]
            self._staging = 0
            self._cond.notify_all()
        for c in empty:  # out of every record: the address may be reused
            self._unreserve(c)
        if kept:
            self._pin_in_threads(kept, background=True)

    def wait_pinned(self, host: int) -> bool:
        """Block until the chunk holding ``host`` is registered (True); False at once for a chunk a staged sleep fills.

        Raises the allocator error if pinning the chunk failed.
        """
        c = self._wait_chunk(host, for_read=False)
        return c.ready

    def wait_readable(self, host: int) -> None:
        """Block until the chunk holding ``host`` may be copied from: registered, or filled and left pageable.

        A chunk a staged sleep filled whose pin failed is copied from as pageable
        memory (slower, same bytes); any other failed pin raises.
        """
        self._wait_chunk(host, for_read=True)

    def _wait_chunk(self, host: int, for_read: bool) -> Chunk:
        with self._cond:
            i = bisect.bisect_right(self._bases, host) - 1
            c = self._chunks.get(self._bases[i]) if i >= 0 else None
            if c is None or host >= c.host + c.nbytes:
                msg = f"host address {host:#x} is in no chunk of the arena ({len(self._chunks)} chunks)"
                raise AllocatorError("pin host memory", None, msg)
            chunk = c
            self._cond.wait_for(lambda: chunk.ready or chunk.staged or chunk.error is not None or self._closed)
            if c.ready or c.staged or (for_read and c.filled and c.error is not None):
                return c
            if c.error is not None:
                raise pin_error(c.error, c.nbytes, self._pinned)
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
        each is unpinned. Empty chunks still being pinned (after a staged
        sleep) are unpinned by their pinning thread once registered.
        """
        with self._cond:
            for c in self._chunks.values():
                c.trim_when_pinned = c.trim_when_pinned or (not c.ready and c.error is None and c.used() == 0)
            empty = [c for c in self._chunks.values() if c.ready and c.used() == 0]
            for c in empty:
                self._remove_locked(c)
            total = sum(c.nbytes for c in empty)
            self._pinned -= total
            self._unpinning += total
            self._target = min(self._target, self._pinned)

        def unpin() -> None:
            for c in empty:
                self._unpin_trimmed(c)

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
            self._pinned = self._pending = self._staging = 0
        if self._thread is not None:
            self._thread.join(timeout=30)
        for c in chunks:
            self._free(c)
        for c in failed:
            self._unreserve(c)
