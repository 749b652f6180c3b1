"""Sleep and wake over the native table: backup copies, release (unmap) pipelined with them, restore, rollback.

:class:`SleepWake` is a part ``TaggedAllocator`` owns, made with the driver,
the table, the host arena, the stager, the tag book and the torch side
(:class:`TorchSide`) it works on. Sleep: :meth:`SleepWake.backup` freezes each
tag in the library (new allocations are refused, frees keep their mappings:
Invariant: freeze before copy), enqueues the copies of each batch of adjacent
allocations on the driver's copy stream and records an event per batch;
:meth:`SleepWake.release` asks the library to unmap each batch as soon as its
copy is done (Invariant: an unmap waits for its copy), so unmapping overlaps
the copies still in flight. Wake maps span after span (one handle per span of
adjacent allocations) and enqueues each span's copy at once, then waits once.
Python holds the book's lock across these steps but never while torch's
allocator could need it (Invariant: the allocator's lock order). What a failed
release does to put its tag back (or release it honestly when that fails too)
is :mod:`torpor.allocator.sleepwake.undo`'s functions. The invariants are named
in docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from torpor.allocator.failures import wrap
from torpor.allocator.host.offload import Extent, HostArena
from torpor.allocator.host.staging import Stager
from torpor.allocator.native import library as native
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import Live, NativeTable
from torpor.allocator.sleepwake.plan import (
    Piece,
    assign,
    batches,
    clip_each,
    copies,
    live_pieces,
    pieces,
    spans,
)
from torpor.allocator.sleepwake.sealing import WakeChecks
from torpor.allocator.sleepwake.tagbook import Bounds, InFlight, TagBook, TagState, refuse_partial
from torpor.allocator.sleepwake.undo import heal, thaw_quietly, undo_release, unmap_restored
from torpor.errors import AllocatorError, UnknownTag, WakeCheckFailed
from torpor.statemachine.core.protocol import Transfer

logger = logging.getLogger("torpor.allocator")


__all__ = ["SleepWake", "TagState", "TorchSide"]


class TorchSide(Protocol):
    """What the cycle needs of the torch side (``TorchBinding`` meets it; off CUDA it has no pools and does nothing)."""

    def live_ranges(self, tag: str) -> dict[int, list[tuple[int, int]]] | None:
        """Allocation address -> the ranges of it in use, where torch says (None: every byte is live)."""
        ...

    def trim_free(self, tags: Sequence[str], synced: bool) -> None:
        """Free segments of torch pools no open block uses go back (neither copied nor mapped on wake).

        Before a sleep, and before a wake maps released tags (issue 51: a segment freed while asleep,
        mapped, would share a span with live allocations, its memory held until they all went; nothing
        of a released tag is mapped, so no queued kernel can touch it: ``synced``).

        ``synced``: the caller synchronized the tags' devices just before (else it does: Invariant: stream-ordered trim).
        """
        ...


class SleepWake:
    """The memory protocol's backup, release, restore and drop_backup over one table, host arena and stager.

    It works under the book's lock (:attr:`TagBook.lock`) on the book's records;
    ``torch`` is the torch side (:class:`TorchSide`), ``granularity(device)`` the
    table's (cached by the allocator), ``group_bytes`` the bytes per pipelined copy
    group and ``piece_bytes`` the largest mapping a wake makes for a tag with a backup.
    """

    def __init__(
        self,
        driver: Driver,
        table: NativeTable,
        host: HostArena,
        stager: Stager,
        book: TagBook,
        torch: TorchSide,
        granularity: Callable[[int], int],
        *,
        group_bytes: int,
        piece_bytes: int,
    ) -> None:
        self.driver = driver
        self.table = table
        self.host = host
        self.stager = stager
        self.book = book
        self.torch = torch
        self.granularity = granularity
        self.group_bytes = group_bytes
        self.piece_bytes = piece_bytes
        self._lock = book.lock
        self._tags = book.records
        self.checks = WakeChecks(driver)  # every wake checked against the sums its sleep sealed (issue 53)

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Copy each tag to pinned host memory (copies finish before :meth:`release` unmaps); all or nothing."""
        with self._lock:
            self._check_known(tags)
            refuse_partial("backup", list(tags), self._tags)
            start = time.perf_counter()
            self.torch.trim_free(tags, synced=False)
            for tag in tags:
                if self.table.usage(tag).state == native.RELEASED:
                    msg = f"tag {tag!r} is released; nothing resident to back up"
                    raise AllocatorError("backup", tag, msg)
            frozen: list[str] = []
            taken: list[TagState] = []
            try:
                for tag in tags:  # Invariant: freeze before copy
                    self.table.freeze(tag)
                    frozen.append(tag)
                lives = {t: self.table.allocations(t) for t in tags}
                for device in {d for live in lives.values() for _, _, d in live}:
                    try:
                        self.driver.synchronize(device)
                    except Exception as exc:
                        raise wrap("backup", None, exc) from exc
                for tag in tags:
                    record = self._tags[tag]
                    self._drop(record)
                    self._take_host(tag, record, live_pieces(lives[tag], self.torch.live_ranges(tag)))
                    taken.append(record)
                for tag in tags:
                    self._enqueue_backup(tag, self._tags[tag], lives[tag])
                try:
                    self.stager.finish()  # a staged sleep's copies are in host memory once this returns
                except AllocatorError as exc:
                    raise wrap("backup", tags[0] if len(tags) == 1 else None, exc) from exc
            except BaseException:  # an error or an interrupt (Ctrl-C): no backup stays half made
                for record in taken:
                    self._drop(record)
                for tag in frozen:
                    thaw_quietly(self.table, tag)
                self.host.end_staging()  # staged chunks left empty go back
                raise
            seconds = time.perf_counter() - start
            return {t: Transfer(t, sum(p.size for p in self._tags[t].pieces), seconds, offloaded=True) for t in tags}

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Release each tag's physical memory; per tag all or nothing (a failed tag stays resident)."""
        with self._lock:
            self._check_known(tags)
            synced = not any(self._tags[t].pending for t in tags)
            if synced:
                devices = {d for t in tags for _, _, d in self.table.allocations(t)}
                for device in devices:
                    try:
                        self.driver.synchronize(device)
                    except Exception as exc:
                        raise wrap("release", None, exc) from exc
            discarded = [t for t in tags if self.table.usage(t).state == native.ACTIVE]
            self.torch.trim_free(discarded, synced)
            out = {}
            try:
                for tag in tags:
                    start = time.perf_counter()
                    record = self._tags[tag]
                    if self.table.usage(tag).state == native.RELEASED:
                        out[tag] = Transfer(tag, 0, 0.0, offloaded=record.backed_up)
                        continue
                    self._release_tag(tag, record)
                    seconds = time.perf_counter() - start
                    out[tag] = Transfer(tag, self.table.usage(tag).nbytes, seconds, offloaded=record.backed_up)
            finally:
                # Invariant: staging ends after the release (registering while it unmaps made both wait on the driver)
                self.host.end_staging()
            return out

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Map each tag back at its addresses and copy its backup in; all or nothing, backups kept."""
        with self._lock:
            self._check_known(tags)
            start = time.perf_counter()
            healed = {t: self._heal_tag(t) for t in tags if self._tags[t].partial}
            todo = [t for t in tags if self.table.usage(t).state == native.RELEASED]
            if todo:  # segments torch holds free (deleted while asleep) are trimmed, not mapped (TorchSide.trim_free)
                try:
                    self.torch.trim_free(todo, synced=True)
                except Exception:  # they are mapped as before
                    logger.warning("a wake maps the free segments of %s: trimming them failed", todo, exc_info=True)
            lives: dict[str, list[Live]] = {}
            current = ""
            try:
                for tag in todo:
                    current = tag
                    if self.table.unmap_all(tag):  # left mapped by a rollback that could not unmap
                        msg = "a mapping left by an earlier failed wake would not unmap"
                        raise AllocatorError("restore", tag, msg)
                    lives[tag] = self.table.allocations(tag)
                    self._forget_freed(self._tags[tag], lives[tag])
                    self._remap(tag, self._tags[tag], lives[tag])
                for device in {d for live in lives.values() for _, _, d in live}:
                    self.driver.wait(self.driver.record(device))
                checked = {}
                for tag in todo:  # the restored bytes against the sums sealed at the release (WakeCheckFailed)
                    current = tag
                    checked[tag] = self.checks.check(tag, self._tags[tag].sums, self._tags[tag].pieces)
            except BaseException as exc:  # an error or an interrupt (Ctrl-C): unmap what this restore mapped
                unmap_restored(self.driver, self.table, todo, lives)
                logger.warning(
                    "Rolling back %d mapped allocation(s) after a failed wake", sum(map(len, lives.values()))
                )
                if not isinstance(exc, Exception) or isinstance(exc, WakeCheckFailed):
                    raise
                raise wrap("restore", current or None, exc) from exc
            seconds = time.perf_counter() - start
            out = {t: Transfer(t, healed.get(t, 0), seconds, offloaded=self._tags[t].backed_up) for t in tags}
            for tag in todo:
                self.table.mark_awake(tag)
                out[tag] = Transfer(
                    tag,
                    sum(a.size for a in lives[tag]),
                    seconds,
                    offloaded=self._tags[tag].backed_up,
                    checked=checked[tag],
                )
            return out

    def drop_backup(self, tags: Sequence[str]) -> None:
        """Mark the tags' backups stale (host extents return to the arena); a frozen tag takes allocations again."""
        with self._lock:
            refuse_partial("drop backup", list(tags), self._tags)
            first: AllocatorError | None = None
            for tag in tags:
                record = self._tags.get(tag)
                if record is not None:
                    self._drop(record)
                    if self.table.usage(tag).state == native.FROZEN:
                        try:
                            self.table.thaw(tag)
                        except AllocatorError as exc:  # the other tags are thawed all the same
                            first = first or exc
            self.host.end_staging()  # a staged backup dropped before its release: its empty chunks go back
            if first is not None:
                raise first

    # -- internals ----------------------------------------------------------------------------

    def _check_known(self, tags: Sequence[str]) -> None:
        unknown = [t for t in tags if t not in self._tags]
        if unknown:
            raise UnknownTag(unknown, self._tags)

    def _take_host(self, tag: str, record: TagState, parts: list[Piece]) -> None:
        total = sum(p.size for p in parts)
        try:
            extents = self.host.take(total, stage=True) if total else []
        except AllocatorError as exc:
            raise wrap("backup", tag, exc) from exc
        record.pieces = parts
        record.backups = assign(parts, extents)
        record.sums = {}  # sealed at the release, once each batch is copied
        record.backed_up = True

    def _enqueue_backup(self, tag: str, record: TagState, live: list[Live]) -> None:
        ends = {a: a + n for a, n, _ in live}
        groups = batches(record.pieces, self.group_bytes)
        try:
            for i, batch in enumerate(groups):
                for device, address, host, n in copies(batch, record.backups, whole=True):
                    # a chunk not pinned yet is filled through the staging ring; where the ring cannot be
                    # pinned, the chunk is pinned now and copied into once it is (chunk by chunk)
                    pinned = self.host.wait_pinned(host)
                    if not pinned and self.stager.copy(host, address, n, device):
                        continue
                    if not pinned:  # the ring gave up: its chunks are being pinned now
                        self.host.wait_pinned(host)
                    self.driver.copy_d2h(host, address, n, device)
                # once copied, the mappings inside whole allocations of this batch may go; an allocation whose
                # pieces continue in the next batch waits for it
                hi = ends[batch[-1].key]
                if i + 1 < len(groups):
                    hi = min(hi, groups[i + 1][0].key)
                record.pending.append(InFlight(self.driver.record(batch[0].device), batch[0].key, hi))
        except BaseException as exc:
            self.settle(record)
            if not isinstance(exc, Exception):  # an interrupt stays an interrupt
                raise
            raise wrap("backup", tag, exc) from exc

    def settle(self, record: TagState) -> list[Bounds]:
        """Wait for the tag's copies in flight; the batches whose copy failed (their backup is not valid)."""
        self.stager.abort()  # a staged sleep's threads write into the backup's host memory until they stop
        failed: list[Bounds] = []
        for event, lo, hi in record.pending:
            try:
                self.driver.wait(event)
            except Exception:  # a backup being dropped, or a failed release that copies these batches again
                logger.debug("a copy failed while its backup was being dropped", exc_info=True)
                failed.append(Bounds(lo, hi))
        record.pending.clear()
        return failed

    def _drop(self, record: TagState) -> None:
        self.settle(record)
        extents: list[Extent] = [e for backup in record.backups.values() for e in backup]
        record.backups = {}
        record.pieces = []
        record.sums = {}
        if extents:  # one give: with keep_after_wake off each give trims
            self.host.give(extents)
        record.backed_up = False

    def forget(self, record: TagState, gone: set[int]) -> None:
        """Give back the backups of the allocations in ``gone`` (freed while asleep)."""
        keep, extents = [], []
        for p in record.pieces:
            if p.key in gone:
                extents += record.backups.pop(p.start, [])
                record.sums.pop(p.start, None)
            else:
                keep.append(p)
        record.pieces = keep
        if extents:
            self.host.give(extents)

    def _forget_freed(self, record: TagState, live: list[Live]) -> None:
        alive = {a.address for a in live}
        self.forget(record, {p.key for p in record.pieces if p.key not in alive})

    def _release_tag(self, tag: str, record: TagState) -> None:
        if self.table.usage(tag).state == native.ACTIVE:  # discarded, or released again on a kept backup
            self.table.freeze(tag)
            if (
                record.backed_up
            ):  # the backup a wake copied in (a failed wake's rollback): it must cover every allocation
                live = self.table.allocations(tag)
                self._forget_freed(record, live)
                backed = {p.key for p in record.pieces}
                missing = [a.address for a in live if a.address not in backed]
                if missing:
                    thaw_quietly(self.table, tag)
                    msg = f"{len(missing)} allocation(s) of tag {tag!r} were made after its backup; back it up again"
                    raise AllocatorError("release", tag, msg)
        pending, record.pending = record.pending, []
        waited, stale = 0, []
        in_order = sorted(record.pieces, key=lambda p: p.start) if record.backed_up else []
        sealed = 0  # the batches' pieces, walked once: each sealed once its copy is done, before its unmap
        try:
            for event, lo, hi in pending:  # Invariant: an unmap waits for its copy
                waited += 1
                try:
                    self.driver.wait(event)
                except BaseException:
                    stale.append(Bounds(lo, hi))  # its copy failed: the backup of this batch is not its bytes
                    raise
                sealed = self.checks.seal(record.sums, in_order, sealed, hi)
                self.table.unmap_range(tag, lo, hi)
            self.checks.seal(record.sums, in_order, sealed)
            self.table.unmap_range(tag)
        except BaseException as exc:  # an error or an interrupt (Ctrl-C): put the tag back, or release it (undo.py)
            record.pending = pending[waited:]
            outcome = undo_release(self.driver, self.table, self.host, tag, record, stale + self.settle(record))
            if not isinstance(exc, Exception):
                raise
            raise wrap("release", tag, exc, outcome) from exc
        self.table.mark_released(tag)

    def _remap(self, tag: str, record: TagState, live: list[Live]) -> None:
        """Map ``live`` span by span (adjacent allocations share one handle), each span's copy enqueued at once."""
        if not live:
            return
        # pieces only where there are copies to pipeline: a tag with no backup (discarded) maps each allocation
        # with one handle, as it was first mapped, so that the next sleep unmaps a few mappings, not hundreds
        gran = self.granularity(live[0].device)
        step = max(self.piece_bytes // gran, 1) * gran if record.backed_up else max(a.size for a in live)
        todo = [
            (span[0].start, sum(p.size for p in span), span[0].device)
            for span in spans(pieces(live, step), self.group_bytes)
        ]
        # only the bytes the backup holds: free blocks come back as fresh memory (one pass over the pieces)
        held = clip_each(record.pieces, [(s, s + n) for s, n, _ in todo]) if record.backed_up else [[] for _ in todo]
        for (start, size, device), parts in zip(todo, held, strict=True):
            self.table.map_span(tag, start, size, device)
            for dev, address, host, n in copies(parts, record.backups):
                self.host.wait_readable(host)  # a staged sleep's chunks are pinned in the background
                self.driver.copy_h2d(address, host, n, dev)

    def _heal_tag(self, tag: str) -> int:
        try:
            return heal(self.driver, self.table, self.host, tag, self._tags[tag])
        except AllocatorError as exc:
            raise wrap("restore", tag, exc, "tag stays partly released; its backup is kept") from exc
