"""The controller's lifecycle: record outside facts and usage, recover after an interruption, close."""

from __future__ import annotations

import threading
import time
from typing import Any

from torpor.errors import CommandInFlight, LogWriteFailed
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.interrupts import UNINTERRUPTED
from torpor.statemachine.machine.base import logger
from torpor.statemachine.machine.gate import CommandGate
from torpor.statemachine.projection.view import Projection

#: How long close() waits for the command lock at a time (a Ctrl-C meanwhile is raised between two waits).
_WAIT_SLICE = 0.1


class Lifecycle(CommandGate):
    """``observe()``, ``record()``, ``recover()`` and ``close()``."""

    def observe(self) -> Projection:
        """Record the memory's current per-tag bytes (a ``usage_observed`` event)."""
        with self._emit_lock:
            self._emit(EventKind.USAGE_OBSERVED, usage=self._resident_usage(), allocations=self._allocation_counts())
            return self.projection

    def record(self, kind: EventKind, **data: Any) -> Event:
        """Record an outside fact (hook decisions, a keeper's backup adopted); returns the event."""
        if kind not in (EventKind.HOOK_DECISION, EventKind.USAGE_OBSERVED, EventKind.BACKUP_ADOPTED):
            msg = (
                "only hook_decision, usage_observed and backup_adopted facts can be recorded from outside, "
                f"not {kind.value!r}"
            )
            raise ValueError(msg)
        return self._emit(kind, **data)

    def recover(self) -> Projection:
        """Accept that an interrupted transition left memory unknown; start clean from the memory as it is.

        Each tag's residency is taken from the memory: a tag with nothing
        resident and bytes on the host (or discarded) is asleep, so the
        controller ends ``awake`` when everything is resident and
        ``partially_awake`` otherwise (a wake then restores the rest).
        """
        with self._command("recover"):
            self._guard("recover")
            return self._reconcile()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return bool(self._closed_at)

    def close(self, timeout: float | None = None) -> None:
        """Record the end of this controller's life and close the log; later commands raise ``ControllerClosed``.

        A command in flight in another thread is waited for (up to ``timeout``
        seconds, None: as long as it takes; past it ``CommandInFlight`` is
        raised and nothing is closed). Called from inside a command (a
        subscriber) it raises ``CommandInFlight`` at once. Closing twice does nothing.
        """
        if self._owner == threading.get_ident():
            raise CommandInFlight("close", self._in_flight, self.state.value)
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
        locked = False
        try:
            while not locked:  # waited for in slices, so that a Ctrl-C meanwhile is raised within one
                left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, max(deadline - time.monotonic(), 0))
                with UNINTERRUPTED:  # no Ctrl-C between taking the lock and the ``finally`` that drops it
                    locked = self._command_lock.acquire(timeout=left)
                if not locked and deadline is not None and time.monotonic() >= deadline:
                    raise CommandInFlight("close", self._in_flight, self.state.value)
            with UNINTERRUPTED, self._emit_lock:  # the ``closed`` event, the mark and the closed log: all or none
                if self._closed_at:
                    return
                try:
                    event = self._emit(EventKind.CLOSED, state=self.state.value)
                    self._closed_at = event.seq
                except LogWriteFailed:
                    logger.exception("torpor: recording 'closed' failed; the log is closed anyway")
                    self._closed_at = self._seq or 1
                if self.log is not None:
                    self.log.close()
        finally:
            if locked:
                self._command_lock.release()
