"""Rollback in one place: the compensating steps of a failed sleep, wake or discard, and the events they record.

A command records what it has done so far in a progress record
(:class:`SleepProgress`, :class:`WakeProgress`); when it fails, the matching
compensation here undoes exactly that, newest first, and records it:

- a sleep that fails maps back what it released and drops the backups it made
  (:func:`abort_sleep`: ``tag_restored`` with ``source="rollback"`` per tag, then
  ``sleep_aborted``; or, when mapping back fails too, ``sleep_completed`` with
  ``incomplete``). A tag whose failed release the memory could not undo is
  released (the memory's ``usage()`` says so): it is recorded as released and
  restored with the others;
- a wake that fails releases again what it mapped, keeping the backups
  (:func:`fail_wake`: ``tag_rolled_back`` per tag, then ``wake_failed``); a
  tag whose release failed is recorded as rolled back when the memory says it
  is not resident, and stays resident otherwise;
- a rollback that leaves memory the log cannot describe (a tag the sleep
  must give back resident is not) records no end: the controller stays in the
  transitional state and refuses with ``NotRecovered`` until ``recover()``;
- a discard cannot bring a dropped backup back: one that fails before anything
  changed is a refusal, one that fails part-way ends partly done
  (:func:`discard_failed`: ``discard_completed`` naming what went and the error);
- a prepared discard another rank refused maps its tags back (:func:`undo_discard`).

Each ends by raising the first error again. Every event a sleep's or a wake's
rollback writes goes through one :class:`Compensation`, which stops recording at
the first event that cannot be written: the log then ends mid-transition and
``recover()`` reconciles it with the memory. See docs/architecture.md
"Invariant: a failed command is undone newest first".
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NoReturn

from torpor.errors import LogWriteFailed, MemoryOperationFailed, TorporError
from torpor.statemachine.core.events import (
    DiscardCompleted,
    SleepAborted,
    SleepCompleted,
    TagReleased,
    TagRestored,
    TagRolledBack,
    WakeFailed,
)
from torpor.statemachine.core.fields import Payload
from torpor.statemachine.core.policy import Action
from torpor.statemachine.core.protocol import Transfer
from torpor.statemachine.machine.context import Context

logger = logging.getLogger("torpor")


class SleepPhase(enum.StrEnum):
    """What a sleep had under way when it failed; its value opens ``sleep_aborted``'s reason (``"release failed: ..."``)."""

    BACKUP = "backup"  #: copying the offloaded tags to the host
    RELEASE = "release"  #: releasing tags' device memory
    GROUP = "group"  #: waiting for the group: another rank failed
    RECORDING = "recording"  #: recording ``sleep_completed``


@dataclass
class SleepProgress:
    """What a sleep has done so far: what :func:`abort_sleep` undoes."""

    level: int
    plan: Mapping[str, Action]
    start: float
    phase: SleepPhase = SleepPhase.BACKUP  # what was under way
    backed_up: list[str] = field(default_factory=list)  # backups this sleep made (dropped again on abort)
    released: list[Transfer] = field(default_factory=list)  # in release order
    failed: str | None = None  # the tag whose release was under way (it may be partly released)

    def lost(self) -> list[str]:
        """Tags whose content a rollback cannot bring back: released (or partly) without a backup."""
        lost = [t.tag for t in self.released if self.plan.get(t.tag) is Action.DISCARD]
        if self.failed is not None and self.plan.get(self.failed) is Action.DISCARD:
            lost.append(self.failed)
        return lost


@dataclass
class WakeProgress:
    """What a wake has done so far: what :func:`fail_wake` undoes."""

    tags: list[str] | None
    start: float
    restored: list[tuple[str, Transfer, str]] = field(default_factory=list)  # (tag, transfer, "host" | "fresh")


class Compensation:
    """The events of one rollback, recorded in order until one cannot be."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self.ok = True

    def record(self, payload: Payload) -> None:
        """Record a rollback step unless an earlier one could not be (then :attr:`ok` is False).

        Once one rollback event is missing, later ones would make the log say
        something the memory does not: the log then ends mid-transition and
        ``recover()`` reconciles it with the memory.
        """
        if not self.ok:
            return
        try:
            self._ctx.recorder.record(payload)
        except LogWriteFailed as exc:
            self.ok = False
            self._ctx.gate.needs_recover(f"the rollback could not be recorded ({exc}); memory was rolled back")
            logger.exception("torpor: recording a rollback failed; the controller needs recover()")


def abort_sleep(ctx: Context, done: SleepProgress, exc: BaseException) -> NoReturn:
    """Undo a sleep that failed: map back what was released, drop backups, stay awake; raise ``exc``."""
    note = Compensation(ctx)
    rollback_error: BaseException | None = None
    _released_anyway(ctx, done, note)
    # A discarded tag had no backup: rolling it back maps fresh memory, its content is gone. Say so.
    lost = done.lost()
    for released in reversed(done.released):
        try:
            back = ctx.memory.restore([released.tag])[released.tag]
        except BaseException as again:  # the first error is raised below
            rollback_error = again
            break
        note.record(
            TagRestored(
                tag=released.tag, bytes=back.bytes, source="rollback", seconds=back.seconds, lost=released.tag in lost
            )
        )
    if rollback_error is not None:
        # Could not undo: what is released stays released; the sleep completes as far as it got.
        note.record(
            SleepCompleted(
                level=done.level,
                seconds=time.perf_counter() - done.start,
                freed=0,
                offloaded=0,
                discarded=0,
                pinned=ctx.host.pinned(),
                incomplete=str(rollback_error),
            )
        )
        if not isinstance(exc, Exception):  # an interrupt stays an interrupt
            raise exc
        raise MemoryOperationFailed(
            "sleep rollback", None, f"{exc}; rolling back failed too: {rollback_error}"
        ) from exc
    _check_resident(ctx, done, exc)
    interrupt: BaseException | None = None
    if done.backed_up:  # backup() cleans up its own failure
        try:
            ctx.memory.drop_backup(done.backed_up)
        except Exception:
            logger.exception("dropping backups after an aborted sleep failed")
        except BaseException as again:  # an interrupt while dropping: the backups leak, the abort goes on
            interrupt = again
    ctx.host.release_unused()
    lost_txt = f"; content of {', '.join(lost)} may be lost (discarded, or partly, before the failure)" if lost else ""
    note.record(
        SleepAborted(
            level=done.level,
            reason=f"{done.phase} failed: {exc}{lost_txt}",
            error=type(exc).__name__,
            seconds=time.perf_counter() - done.start,
            usage=ctx.resident_usage(),
            lost=tuple(lost),
        )
    )
    if done.released:
        logger.warning("Rolled back %d released tag(s) after a failed sleep%s", len(done.released), lost_txt)
    if interrupt is not None and isinstance(exc, Exception):
        raise interrupt from exc
    raise exc


def not_resident(ctx: Context, tag: str) -> int:
    """The bytes of ``tag`` the memory holds released (on the host or discarded); 0 when it is resident or empty."""
    usage = ctx.memory.usage().get(tag)
    if usage is None or usage.resident:
        return 0
    return usage.host or usage.discarded


def _released_anyway(ctx: Context, done: SleepProgress, note: Compensation) -> None:
    """The tag whose release failed is released after all (its undo failed too): record it, so the rollback restores it."""
    tag = done.failed
    if tag is None:
        return
    nbytes = not_resident(ctx, tag)
    if not nbytes:
        return
    action = done.plan[tag].value
    note.record(TagReleased(tag=tag, bytes=nbytes, action=action, seconds=0.0))
    done.released.append(Transfer(tag, nbytes, 0.0, offloaded=done.plan[tag] is Action.OFFLOAD))
    done.failed = None


def _check_resident(ctx: Context, done: SleepProgress, exc: BaseException) -> None:
    """Before ``sleep_aborted`` says the engine is awake: every planned tag is resident, or the controller needs recover()."""
    away = [t for t in done.plan if not_resident(ctx, t)]
    if not away:
        return
    why = f"the rollback of a failed sleep left {', '.join(away)} not resident ({exc})"
    ctx.gate.needs_recover(f"{why}; recover() takes each tag's residency from the memory")
    logger.error("torpor: %s; the controller needs recover()", why)
    if not isinstance(exc, Exception):
        raise exc
    msg = f"{exc}; {why}: the controller needs recover()"
    raise MemoryOperationFailed("sleep rollback", None, msg) from exc


def fail_wake(ctx: Context, done: WakeProgress, exc: BaseException) -> NoReturn:
    """Undo a wake that failed: release again what it mapped (backups are still there), back to asleep; raise ``exc``."""
    note = Compensation(ctx)
    if done.restored:
        logger.warning("Rolling back %d mapped tag(s)", len(done.restored))
    for tag, transfer, source in reversed(done.restored):
        action = "offload" if source == "host" else "discard"
        try:
            ctx.memory.release([tag])
        except BaseException:  # the first error is raised below
            usage = ctx.memory.usage().get(tag)
            if usage is None or usage.resident or not (usage.host or usage.discarded):
                logger.exception("rolling back tag %r after a failed wake failed; it stays resident", tag)
                continue
            logger.exception("rolling back tag %r after a failed wake failed; the memory released it all the same", tag)
        note.record(TagRolledBack(tag=tag, bytes=transfer.bytes, action=action))
    note.record(
        WakeFailed(
            tags=None if done.tags is None else tuple(done.tags),
            reason=str(exc),
            error=type(exc).__name__,
            seconds=time.perf_counter() - done.start,
        )
    )
    raise exc


def discard_failed(
    ctx: Context, start: float, exc: TorporError, *, changed: bool, went: list[str], note: str = ""
) -> NoReturn:
    """End a discard that failed: a refusal when nothing ``changed`` yet, else partly done; raise ``exc``.

    A dropped backup cannot come back, so nothing is undone: ``discard_completed``
    lists the tags that ``went`` (and says why it stopped, with ``note`` added).
    """
    if not changed:
        ctx.gate.refuse("discard", exc)
    ctx.recorder.record(
        DiscardCompleted(
            tags=tuple(went), error=type(exc).__name__, reason=f"{exc}{note}", seconds=time.perf_counter() - start
        )
    )
    raise exc


def undo_discard(wake: Callable[[list[str]], object], tags: list[str], error: TorporError) -> NoReturn:
    """Compensate a prepared discard of resident tags: map them back (fresh memory) with ``wake``, then raise ``error``."""
    if tags:
        wake(tags)
    raise error
