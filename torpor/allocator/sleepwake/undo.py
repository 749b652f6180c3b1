"""Undoing a failed release: map back and copy the backup in, or, when that fails too, release the tag instead.

A sleep's release unmaps a tag batch by batch; when an unmap (or a copy the
unmap waits for) fails, :func:`undo_release` puts the tag back as
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
  ``usage()`` counts it as not resident (on the host), :func:`heal`
  maps the rest back and copies the backup in at the next restore, and
  backup and drop_backup refuse it until then.
"""

from __future__ import annotations

import logging

from torpor.allocator.host.offload import HostArena
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import Live, NativeTable, Span
from torpor.allocator.sleepwake.plan import clip_each, copies
from torpor.allocator.sleepwake.tagbook import Bounds, TagState
from torpor.errors import AllocatorError

logger = logging.getLogger("torpor.allocator")


def thaw_quietly(table: NativeTable, tag: str) -> None:
    """Let ``tag`` take allocations again; a refusal is logged (the tag stays frozen), never raised."""
    try:
        table.thaw(tag)
    except AllocatorError:
        logger.exception("tag %r stays frozen (no new allocations) after a failed sleep step", tag)


def undo_release(
    driver: Driver, table: NativeTable, host: HostArena, tag: str, record: TagState, stale: list[Bounds]
) -> str:
    """Put a tag whose release failed back, or release it; what it left, for the error. Never raises an error.

    ``stale``: the batches whose copy failed (their backup is not the
    device's bytes; they were not unmapped).
    """
    ranges, error = table.map_back_some(tag)
    copied = error is None and _copy_back(driver, host, tag, record, ranges)
    if copied:
        thaw_quietly(table, tag)
        fresh = 0 if record.backed_up else sum(r.size for r in ranges)
        return "tag left resident" + (f"; {fresh} bytes mapped back fresh (no backup)" if fresh else "")
    why = f"mapping it back failed too ({error.call}: {error.reason})" if error else "copying it back failed too"
    logger.error("rollback: %s for tag %r; releasing it instead", why, tag)
    if record.backed_up and stale and not _backup_again(driver, host, tag, record, stale):
        return _left_partial(record, ranges, why)
    try:
        table.unmap_range(tag)
        table.mark_released(tag)
    except AllocatorError:
        logger.exception("rollback: releasing tag %r after a failed map back failed as well", tag)
        return _left_partial(record, ranges, why)
    if record.backed_up:
        return f"{why}; tag released instead, its backup holds every byte: a wake maps it back"
    return f"{why}; tag released instead (no backup: its content is gone)"


def _left_partial(record: TagState, ranges: list[Span], why: str) -> str:
    record.partial = True
    record.refill = [*record.refill, *ranges]
    return f"{why}; tag left partly released (not resident): its backup is kept and a wake maps the rest back"


def _copy_back(driver: Driver, host: HostArena, tag: str, record: TagState, ranges: list[Span]) -> bool:
    """Copy the backup into ``ranges`` and wait; False when a copy failed (logged). True without a backup."""
    if not record.backed_up or not ranges:
        return True
    try:
        ordered = sorted(set(ranges))
        devices = set()
        for parts in clip_each(record.pieces, [(r.start, r.start + r.size) for r in ordered]):
            for device, address, chunk, m in copies(parts, record.backups):
                host.wait_readable(chunk)
                driver.copy_h2d(address, chunk, m, device)
                devices.add(device)
        for device in devices:
            driver.wait(driver.record(device))
    except Exception:
        logger.exception("rollback: copying the backup of tag %r back failed", tag)
        return False
    return True


def _backup_again(driver: Driver, host: HostArena, tag: str, record: TagState, stale: list[Bounds]) -> bool:
    """Copy the ``stale`` batches (still mapped) into the backup again; False when that fails (logged)."""
    try:
        devices = set()
        for parts in clip_each(record.pieces, sorted(stale)):
            for device, address, chunk, n in copies(parts, record.backups):
                if not host.wait_pinned(chunk):  # a staged chunk, still pageable: no device copy into it
                    logger.error("rollback: the backup of tag %r is not pinned yet; cannot copy it again", tag)
                    return False
                driver.copy_d2h(chunk, address, n, device)
                devices.add(device)
        for device in devices:
            driver.wait(driver.record(device))
    except Exception:
        logger.exception("rollback: copying tag %r to its backup again failed", tag)
        return False
    return True


def heal(driver: Driver, table: NativeTable, host: HostArena, tag: str, record: TagState) -> int:
    """Map back the rest of a partly released tag and copy its backup in, then thaw it; the bytes mapped back."""
    ranges, error = table.map_back_some(tag)
    record.refill = [*record.refill, *ranges]
    if error is not None:
        raise error
    if not _copy_back(driver, host, tag, record, record.refill):
        msg = "copying its backup into the memory mapped back failed; the tag stays partly released"
        raise AllocatorError("restore", tag, msg)
    table.thaw(tag)
    mapped = sum(r.size for r in record.refill)
    record.partial, record.refill = False, []
    return mapped


def unmap_restored(driver: Driver, table: NativeTable, todo: list[str], lives: dict[str, list[Live]]) -> None:
    """Roll a failed wake back: wait for the devices it copied to, then unmap every mapping of the tags it restored."""
    for device in {a.device for live in lives.values() for a in live}:
        try:
            driver.synchronize(device)
        except Exception:  # the wake failed already; unmap what we can
            logger.exception("synchronizing before rolling back a wake failed")
    for tag in todo:
        failed = table.unmap_all(tag)
        if failed:  # they stay listed; the next wake unmaps them first
            logger.error("rollback: %d mapping(s) of tag %r would not unmap", failed, tag)
