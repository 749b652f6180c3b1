"""Rollback in one place: the compensating steps of a failed sleep, wake or group discard, and the events they record.

A sleep that fails maps back what it released and drops the backups it made
(:func:`abort_sleep`); a wake that fails releases again what it mapped
(:func:`fail_wake`); a prepared discard another rank refused maps its tags back
(:func:`undo_discard`). Each ends by raising the first error again. Every event
a rollback writes goes through one :class:`Compensation`, which stops recording
at the first event that cannot be written: the log then ends mid-transition and
``recover()`` reconciles it with the memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from torpor.errors import LogWriteFailed, MemoryOperationFailed, TorporError
from torpor.statemachine.base import ControllerBase, logger
from torpor.statemachine.events import EventKind
from torpor.statemachine.hostmem import pinned_bytes, release_unused_host
from torpor.statemachine.policy import Action
from torpor.statemachine.protocol import Transfer


class Compensation:
    """The events of one rollback, recorded in order until one cannot be."""

    def __init__(self, ctl: ControllerBase) -> None:
        self._ctl = ctl
        self.ok = True

    def record(self, kind: EventKind, **data: Any) -> bool:
        """Record a rollback step unless an earlier one could not be; False (and :attr:`ok` False) if not recorded.

        Once one rollback event is missing, later ones would make the log say
        something the memory does not: the log then ends mid-transition and
        ``recover()`` reconciles it with the memory.
        """
        if not self.ok:
            return False
        try:
            self._ctl._emit(kind, **data)
        except LogWriteFailed as exc:
            self.ok = False
            self._ctl._log_failure = f"the rollback could not be recorded ({exc}); memory was rolled back"
            logger.exception("torpor: recording a rollback failed; the controller needs recover()")
            return False
        return True


def abort_sleep(
    ctl: ControllerBase,
    level: int,
    start: float,
    phase: str,
    exc: BaseException,
    released: list[Transfer],
    plan: Mapping[str, Action],
    backed_up: list[str],
    failed: str | None,
) -> NoReturn:
    """Undo a sleep that failed: map back what was released, drop backups, stay awake; raise ``exc``."""
    note = Compensation(ctl)
    rollback_error: BaseException | None = None
    # A discarded tag had no backup: rolling it back maps fresh memory, its content is gone. Say so.
    # The tag whose release failed may be partly released already (some allocations unmapped).
    lost = [t.tag for t in released if plan.get(t.tag) is Action.DISCARD]
    if failed is not None and plan.get(failed) is Action.DISCARD:
        lost.append(failed)
    for done in reversed(released):
        try:
            back = ctl.memory.restore([done.tag])[done.tag]
        except BaseException as again:  # the first error is raised below
            rollback_error = again
            break
        note.record(
            EventKind.TAG_RESTORED,
            tag=done.tag,
            bytes=back.bytes,
            source="rollback",
            seconds=back.seconds,
            lost=done.tag in lost,
        )
    if rollback_error is not None:
        # Could not undo: what is released stays released; the sleep completes as far as it got.
        if note.record(
            EventKind.SLEEP_COMPLETED,
            level=level,
            seconds=time.perf_counter() - start,
            freed=0,
            offloaded=0,
            discarded=0,
            pinned=pinned_bytes(ctl.memory),
            incomplete=str(rollback_error),
        ):
            ctl._step("finish_sleep")
        if not isinstance(exc, Exception):  # an interrupt stays an interrupt
            raise exc
        raise MemoryOperationFailed(
            "sleep rollback", None, f"{exc}; rolling back failed too: {rollback_error}"
        ) from exc
    interrupt: BaseException | None = None
    if backed_up:  # backup() cleans up its own failure
        try:
            ctl.memory.drop_backup(backed_up)
        except Exception:
            logger.exception("dropping backups after an aborted sleep failed")
        except BaseException as again:  # an interrupt while dropping: the backups leak, the abort goes on
            interrupt = again
    release_unused_host(ctl.memory, ctl.host_policy)
    lost_txt = f"; content of {', '.join(lost)} may be lost (discarded, or partly, before the failure)" if lost else ""
    if note.record(
        EventKind.SLEEP_ABORTED,
        level=level,
        reason=f"{phase} failed: {exc}{lost_txt}",
        error=type(exc).__name__,
        seconds=time.perf_counter() - start,
        usage=ctl._resident_usage(),
        lost=lost,
    ):
        ctl._step("abort_sleep")
    if released:
        logger.warning("Rolled back %d released tag(s) after a failed sleep%s", len(released), lost_txt)
    if interrupt is not None and isinstance(exc, Exception):
        raise interrupt from exc
    raise exc


def fail_wake(
    ctl: ControllerBase,
    tags: list[str] | None,
    start: float,
    exc: BaseException,
    restored: list[tuple[str, Transfer, str]],
) -> NoReturn:
    """Undo a wake that failed: release again what it mapped (backups are still there), back to asleep; raise ``exc``."""
    note = Compensation(ctl)
    if restored:
        logger.warning("Rolling back %d mapped tag(s)", len(restored))
    for tag, done, source in reversed(restored):
        action = "offload" if source == "host" else "discard"
        try:
            ctl.memory.release([tag])
        except BaseException:  # the first error is raised below
            logger.exception("rolling back tag %r after a failed wake failed; it stays resident", tag)
            continue
        note.record(EventKind.TAG_ROLLED_BACK, tag=tag, bytes=done.bytes, action=action)
    if note.record(
        EventKind.WAKE_FAILED,
        tags=tags,
        reason=str(exc),
        error=type(exc).__name__,
        seconds=time.perf_counter() - start,
    ):
        ctl._step("fail_wake")
    raise exc


def undo_discard(wake: Callable[[list[str]], object], tags: list[str], error: TorporError) -> NoReturn:
    """Compensate a prepared discard of resident tags: map them back (fresh memory) with ``wake``, then raise ``error``."""
    if tags:
        wake(tags)
    raise error
