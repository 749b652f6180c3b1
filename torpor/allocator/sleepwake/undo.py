"""Undoing a failed release: map back and copy the backup in, or, when that fails too, release the tag instead.

A sleep's release unmaps a tag batch by batch; when an unmap (or a copy the
unmap waits for) fails, :meth:`ReleaseUndo._undo_release` puts the tag back as
it was: the library maps back what was unmapped (fresh memory) and the backup
is copied into every range it mapped. When that cannot complete (a second
fault: the map back or a copy fails) the tag is never reported resident:

- its backup holds every byte (re-copied first from the device for a batch
  whose copy had failed), so the tag is released instead, as a sleep would
  leave it: ``usage()`` says so and a wake (the controller's rollback, or
  the next wake) maps it back from the backup;
- a tag without a backup (discarded) is released too: its content is gone,
  as the discard meant;
- when even that fails (a third fault), the tag is *partly released*: frozen,
  part of it unmapped, the backup kept (it alone holds the unmapped bytes).
  ``usage()`` counts it as not resident (on the host), :meth:`ReleaseUndo._heal`
  maps the rest back and copies the backup in at the next restore, and
  backup and drop_backup refuse it until then.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from torpor.allocator.errors import AllocatorError
from torpor.allocator.host.offload import HostArena
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.plan import Backups, Piece, clip_each, copies

logger = logging.getLogger("torpor.allocator")

Span = tuple[int, int]  # start, bytes


@dataclass
class TagState:
    """Python's part of a tag: its backup (host extents per allocation) and the copies still in flight."""

    backed_up: bool = False
    pieces: list[Piece] = field(default_factory=list)  # what the backup holds: (allocation, start, size, device)
    backups: Backups = field(default_factory=dict)  # piece start -> host extents
    pending: list[tuple[object, int, int]] = field(default_factory=list)  # (event, lo, hi) per batch
    partial: bool = False  # a failed release could not be undone nor completed: part of the tag is unmapped
    refill: list[Span] = field(default_factory=list)  # partial: ranges mapped back fresh, to copy the backup into


class ReleaseUndo:
    """What a failed release does to put its tag back, or to release it honestly (mixed into SleepWake)."""

    driver: Driver
    table: NativeTable
    host: HostArena
    _lock: threading.RLock

    def _thaw_quietly(self, tag: str) -> None:  # provided by SleepWake
        raise NotImplementedError

    def _undo_release(self, tag: str, record: TagState, stale: list[Span]) -> str:
        """Put a tag whose release failed back, or release it; what it left, for the error. Never raises an error.

        ``stale``: the batches whose copy failed (their backup is not the
        device's bytes; they were not unmapped).
        """
        ranges, error = self.table.map_back_some(tag)
        copied = error is None and self._copy_back(tag, record, ranges)
        if copied:
            self._thaw_quietly(tag)
            fresh = 0 if record.backed_up else sum(n for _, n in ranges)
            return "tag left resident" + (f"; {fresh} bytes mapped back fresh (no backup)" if fresh else "")
        why = f"mapping it back failed too ({error.call}: {error.reason})" if error else "copying it back failed too"
        logger.error("rollback: %s for tag %r; releasing it instead", why, tag)
        if record.backed_up and stale and not self._backup_again(tag, record, stale):
            return self._left_partial(tag, record, ranges, why)
        try:
            self.table.unmap_range(tag)
            self.table.mark_released(tag)
        except AllocatorError:
            logger.exception("rollback: releasing tag %r after a failed map back failed as well", tag)
            return self._left_partial(tag, record, ranges, why)
        if record.backed_up:
            return f"{why}; tag released instead, its backup holds every byte: a wake maps it back"
        return f"{why}; tag released instead (no backup: its content is gone)"

    def _left_partial(self, tag: str, record: TagState, ranges: list[Span], why: str) -> str:
        record.partial = True
        record.refill = [*record.refill, *ranges]
        return f"{why}; tag left partly released (not resident): its backup is kept and a wake maps the rest back"

    def _copy_back(self, tag: str, record: TagState, ranges: list[Span]) -> bool:
        """Copy the backup into ``ranges`` and wait; False when a copy failed (logged). True without a backup."""
        if not record.backed_up or not ranges:
            return True
        try:
            ordered = sorted(set(ranges))
            devices = set()
            for parts in clip_each(record.pieces, [(lo, lo + n) for lo, n in ordered]):
                for device, address, host, m in copies(parts, record.backups):
                    self.host.wait_readable(host)
                    self.driver.copy_h2d(address, host, m, device)
                    devices.add(device)
            for device in devices:
                self.driver.wait(self.driver.record(device))
        except Exception:
            logger.exception("rollback: copying the backup of tag %r back failed", tag)
            return False
        return True

    def _backup_again(self, tag: str, record: TagState, stale: list[Span]) -> bool:
        """Copy the ``stale`` batches (still mapped) into the backup again; False when that fails (logged)."""
        try:
            devices = set()
            for parts in clip_each(record.pieces, sorted(stale)):
                for device, address, host, n in copies(parts, record.backups):
                    if not self.host.wait_pinned(host):  # a staged chunk, still pageable: no device copy into it
                        logger.error("rollback: the backup of tag %r is not pinned yet; cannot copy it again", tag)
                        return False
                    self.driver.copy_d2h(host, address, n, device)
                    devices.add(device)
            for device in devices:
                self.driver.wait(self.driver.record(device))
        except Exception:
            logger.exception("rollback: copying tag %r to its backup again failed", tag)
            return False
        return True

    def _heal(self, tag: str, record: TagState) -> int:
        """Map back the rest of a partly released tag and copy its backup in, then thaw it; the bytes mapped back."""
        ranges, error = self.table.map_back_some(tag)
        record.refill = [*record.refill, *ranges]
        if error is not None:
            raise error
        if not self._copy_back(tag, record, record.refill):
            msg = "copying its backup into the memory mapped back failed; the tag stays partly released"
            raise AllocatorError("restore", tag, msg)
        self.table.thaw(tag)
        mapped = sum(n for _, n in record.refill)
        record.partial, record.refill = False, []
        return mapped

    def _refuse_partial(self, operation: str, tags: list[str], records: dict[str, TagState]) -> None:
        """Refuse ``operation`` on a partly released tag: its backup alone holds part of its bytes."""
        for tag in tags:
            record = records.get(tag)
            if record is not None and record.partial:
                msg = (
                    f"tag {tag!r} is partly released after a failed release; wake it first (its backup holds the rest)"
                )
                raise AllocatorError(operation, tag, msg)
