"""The command gate: one command at a time, the transition guard, refusals recorded with a reason, idempotent no-ops.

Every command of :class:`~torpor.statemachine.machine.controller.SleepController`
enters through :meth:`Gate.command` (serialized, never queued: a second one is
refused with ``CommandInFlight``; a closed controller raises
``ControllerClosed``; see docs/architecture.md "Invariant: one command at a
time"), is checked against the transition table
(:func:`~torpor.statemachine.core.states.decide`, and nothing else decides
whether a state accepts a command), and leaves through :meth:`Gate.refuse` (a
``refused`` event, then the error) or :meth:`Gate.repeated` (a
``command_repeated`` no-op) when it does nothing.

The table is asked twice on the same verdict: at the entry, where an
interrupted log (``NotRecovered``) is refused before any argument is read
(the memory is unknown), and in :meth:`Gate.guard`, which each command calls
once its arguments are checked and its idempotent no-op ruled out; it raises
the verdict's refusal (``InvalidTransition``, or ``PoolBusy`` for a pool asleep
with the engine) built by :meth:`Gate.refusal`. The gate also holds why the
controller needs ``recover()`` (:attr:`Gate.log_failure`): set by a rollback
whose events could not be written, cleared by the reconciliation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from torpor.errors import (
    CommandInFlight,
    ControllerClosed,
    InvalidTransition,
    LogWriteFailed,
    NotRecovered,
    PoolBusy,
    TorporError,
)
from torpor.statemachine.core.events import CommandRepeated, Refused
from torpor.statemachine.core.states import Verdict, decide
from torpor.statemachine.log.interrupts import UNINTERRUPTED
from torpor.statemachine.machine.identity import _clip
from torpor.statemachine.machine.recorder import Recorder, logger
from torpor.statemachine.projection.view import Projection

#: How long :meth:`Gate.exclusive` waits for the command lock at a time (a Ctrl-C meanwhile is raised between two waits).
_WAIT_SLICE = 0.1


class Gate:
    """The entry and the refusals every command goes through; its state: the lock, the command in flight, its thread."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self._lock = threading.Lock()
        self.in_flight = ""  # the command in flight, with its arguments
        self.owner: int | None = None  # the thread running the command in flight
        self.log_failure = ""  # why a rollback could not be recorded (then only recover() is accepted)

    def _closed(self, command: str) -> ControllerClosed:
        rec = self._recorder
        return ControllerClosed(command, rec.engine, rec.rank, rec.closed_at)

    @contextmanager
    def command(self, name: str, **args: Any) -> Iterator[None]:
        """Run the block as command ``name``: alone (else ``CommandInFlight``), refused once closed or not recovered."""
        if self._recorder.closed_at:
            raise self._closed(name)
        locked = False
        try:
            with UNINTERRUPTED:  # no Ctrl-C between taking the lock and the ``finally`` that drops it
                locked = self._lock.acquire(blocking=False)
            if not locked:
                self.refuse(name, CommandInFlight(name, self.in_flight, self._state()))
            if self._recorder.closed_at:  # closed while this command waited for nothing: close() held the lock
                raise self._closed(name)
            self.owner = threading.get_ident()
            self.in_flight = f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
            verdict = decide(self._recorder.projection.state, name)
            if verdict.error is NotRecovered:  # before any argument is read: the memory is unknown
                self.refuse(name, self.refusal(verdict))
            yield
        finally:
            held_back: BaseException | None = None
            while locked:  # a signal handler may raise as the block is entered: the lock is dropped all the same
                try:
                    with UNINTERRUPTED:
                        self.in_flight = ""
                        self.owner = None
                        self._lock.release()
                        locked = False
                except BaseException as exc:
                    if not locked:  # raised right after the lock was dropped: the usual place
                        raise
                    held_back = exc
            if held_back is not None:
                raise held_back

    @contextmanager
    def exclusive(self, name: str, timeout: float | None) -> Iterator[None]:
        """Hold the command lock for ``name`` (``close``), waiting for a command in flight up to ``timeout`` s.

        Past ``timeout`` (None: as long as it takes), or called from inside a
        command (a subscriber), ``CommandInFlight`` is raised and nothing is done.
        """
        if self.owner == threading.get_ident():
            raise CommandInFlight(name, self.in_flight, self._state())
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0)
        locked = False
        try:
            while not locked:  # waited for in slices, so that a Ctrl-C meanwhile is raised within one
                left = _WAIT_SLICE if deadline is None else min(_WAIT_SLICE, max(deadline - time.monotonic(), 0))
                with UNINTERRUPTED:  # no Ctrl-C between taking the lock and the ``finally`` that drops it
                    locked = self._lock.acquire(timeout=left)
                if not locked and deadline is not None and time.monotonic() >= deadline:
                    raise CommandInFlight(name, self.in_flight, self._state())
            yield
        finally:
            if locked:
                self._lock.release()

    def _state(self) -> str:
        return self._recorder.projection.state.value

    def needs_recover(self, why: str) -> None:
        """Refuse every command but ``recover()`` from now on (``NotRecovered`` naming ``why``)."""
        self.log_failure = why

    def recovered(self) -> None:
        """The memory was reconciled with the log: commands are accepted again."""
        self.log_failure = ""

    def repeated(self, command: str, args: dict[str, Any], reason: str) -> Projection:
        """Record a retried command whose effect already holds; nothing else changes."""
        self._recorder.record(CommandRepeated(command=command, args=args, state=self._state(), reason=reason))
        logger.info("torpor: %s(%s) is a no-op: %s", command, args, reason)
        return self._recorder.projection

    def guard(self, command: str) -> None:
        """Refuse ``command`` unless the transition table accepts it in the current state."""
        verdict = decide(self._recorder.projection.state, command)
        if verdict.error is not None:
            self.refuse(command, self.refusal(verdict))

    def refusal(self, verdict: Verdict) -> TorporError:
        """The error of a refused verdict, naming the command, the state, since when, and what holds it there."""
        projection = self._recorder.projection
        state, since = verdict.state.value, projection.since
        if verdict.error is NotRecovered:
            return NotRecovered(state, projection.last_seq, projection.last_step, cause=self.log_failure)
        if verdict.error is PoolBusy:
            graphs = projection.graph_count
            held = f"; {graphs} graph(s) captured into it" if graphs else ""
            msg = (
                f"{verdict.reason} (state {state!r} since event #{since}{held}): "
                "freeing it would unmap a second time; wake first"
            )
            return PoolBusy(msg)
        wall = time.strftime("%H:%M:%S", time.localtime(projection.since_wall)) if projection.since_wall else ""
        return InvalidTransition(verdict.command, state, since, verdict.allowed, verdict.reason, since_wall=wall)

    def refuse(self, command: str, error: TorporError) -> NoReturn:
        """Record the refusal of ``command`` (a ``refused`` event naming the error and its holders), then raise ``error``."""
        # Bounded so that a refusal of oversized input (a huge tag name) is still logged, not EventTooLarge.
        holders = [_clip(str(h), 128) for h in list(getattr(error, "holders", ()))[:16]]
        try:
            self._recorder.record(
                Refused(
                    command=command,
                    reason=_clip(str(error), 2048),
                    error=type(error).__name__,
                    holders=tuple(holders),
                    state=self._state(),
                )
            )
        except LogWriteFailed:  # the refusal is what the caller must see; the log says why it lacks it
            logger.exception("torpor: recording the refusal of %s failed", command)
        raise error
