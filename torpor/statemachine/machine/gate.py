"""The command gate: one command at a time, the transition guard, refusals recorded with a reason, idempotent no-ops.

Every command of :class:`~torpor.statemachine.machine.controller.SleepController`
enters through :meth:`CommandGate._command` (serialized, never queued: a second
one is refused with ``CommandInFlight``; a closed controller raises
``ControllerClosed``), is checked against the transition table
(:func:`~torpor.statemachine.core.states.decide`, and nothing else decides whether a
state accepts a command), and leaves through :meth:`CommandGate._refuse` (a
``refused`` event, then the error) or :meth:`CommandGate._repeated` (a
``command_repeated`` no-op) when it does nothing. An interrupt
(``KeyboardInterrupt``, ``SystemExit``, or whatever a signal handler raises,
such as a watchdog's timeout) that leaves a command mid-transition is
reconciled with the memory before it is raised (:meth:`CommandGate._settle`).

The table is asked twice on the same verdict: at the entry, where an
interrupted log (``NotRecovered``) is refused before any argument is read
(the memory is unknown), and in :meth:`CommandGate._guard`, which each command
calls once its arguments are checked and its idempotent no-op ruled out; it
raises the verdict's refusal (``InvalidTransition``, or ``PoolBusy`` for a pool
asleep with the engine) built by :meth:`CommandGate._refusal`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torpor.errors import (
    CommandInFlight,
    ControllerClosed,
    InvalidTransition,
    LogWriteFailed,
    NotRecovered,
    PoolBusy,
    TorporError,
    UnknownTag,
)
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.states import TRANSITIONAL, Verdict, decide
from torpor.statemachine.log.interrupts import UNINTERRUPTED
from torpor.statemachine.machine.base import ControllerBase, _clip, logger
from torpor.statemachine.projection.view import Projection


class CommandGate(ControllerBase):
    """The entry and the refusals every command goes through."""

    @contextmanager
    def _command(self, name: str, **args: Any) -> Iterator[None]:
        if self._closed_at:
            raise ControllerClosed(name, self.engine, self.rank, self._closed_at)
        locked = False
        try:
            with UNINTERRUPTED:  # no Ctrl-C between taking the lock and the ``finally`` that drops it
                locked = self._command_lock.acquire(blocking=False)
            if not locked:
                self._refuse(name, CommandInFlight(name, self._in_flight, self.state.value))
            if self._closed_at:  # closed while this command waited for nothing: close() held the lock
                raise ControllerClosed(name, self.engine, self.rank, self._closed_at)
            self._owner = threading.get_ident()
            self._in_flight = f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
            verdict = decide(self.state, name)
            if verdict.error is NotRecovered:  # before any argument is read: the memory is unknown
                self._refuse(name, self._refusal(verdict))
            try:
                yield
            except BaseException as exc:  # an interrupt, or whatever a signal handler raised: the process lives on
                self._settle(name, exc)
                raise
        finally:
            held_back: BaseException | None = None
            while locked:  # a signal handler may raise as the block is entered: the lock is dropped all the same
                try:
                    with UNINTERRUPTED:
                        self._in_flight = ""
                        self._owner = None
                        self._command_lock.release()
                        locked = False
                except BaseException as exc:
                    if not locked:  # raised right after the lock was dropped: the usual place
                        raise
                    held_back = exc
            if held_back is not None:
                raise held_back

    def _settle(self, command: str, exc: BaseException) -> None:
        """An interrupt that leaves ``command`` mid-transition (it landed where no rollback catches it): reconcile now.

        The process is alive, so the memory is known: the controller takes
        each tag's residency from it, as :meth:`_reconcile` (``recover()``)
        does, instead of waiting in a transitional state for a ``recover()``.
        Not when the log could not record something (``NotRecovered`` names
        it then) or the memory cannot say: then ``recover()`` stays the way out.
        """
        if self.state not in TRANSITIONAL or self._log_failure or self._closed_at:
            return
        try:
            with UNINTERRUPTED:
                logger.warning(
                    "torpor: %s interrupted (%s) in %s at %s; reconciling with the memory as recover() does",
                    command,
                    type(exc).__name__,
                    self.state.value,
                    self.projection.last_step,
                )
                self._reconcile()
        except Exception:
            logger.exception("torpor: reconciling after an interrupted %s failed; recover() is needed", command)

    def _reconcile(self) -> Projection:
        """Take each tag's residency from the memory and record it (``recovered``); the body of ``recover()``.

        A tag with nothing resident and bytes on the host (or discarded) is
        asleep, so the controller ends ``awake`` when everything is resident
        and ``partially_awake`` otherwise (a wake then restores the rest).
        """
        usage = self.memory.usage()
        released = {
            tag: {"host": u.host, "discarded": u.discarded}
            for tag, u in usage.items()
            if not u.resident and (u.host or u.discarded)
        }
        self._emit(
            EventKind.RECOVERED,
            usage={tag: u.resident for tag, u in usage.items()},
            released=released,
            interrupted_state=self.state.value,
            interrupted_step=self.projection.last_step,
        )
        self._log_failure = ""
        return self.projection

    def _repeated(self, command: str, args: dict[str, Any], reason: str) -> Projection:
        """Record a retried command whose effect already holds; nothing else changes."""
        self._emit(EventKind.COMMAND_REPEATED, command=command, args=args, state=self.state.value, reason=reason)
        logger.info("torpor: %s(%s) is a no-op: %s", command, args, reason)
        return self.projection

    def _guard(self, command: str) -> None:
        """Refuse ``command`` unless the transition table accepts it in the current state."""
        verdict = decide(self.state, command)
        if verdict.error is not None:
            self._refuse(command, self._refusal(verdict))

    def _refusal(self, verdict: Verdict) -> TorporError:
        """The error of a refused verdict, naming the command, the state, since when, and what holds it there."""
        state, since = verdict.state.value, self.projection.since
        if verdict.error is NotRecovered:
            return NotRecovered(state, self.projection.last_seq, self.projection.last_step, cause=self._log_failure)
        if verdict.error is PoolBusy:
            graphs = self.projection.graph_count
            held = f"; {graphs} graph(s) captured into it" if graphs else ""
            msg = (
                f"{verdict.reason} (state {state!r} since event #{since}{held}): "
                "freeing it would unmap a second time; wake first"
            )
            return PoolBusy(msg)
        wall = (
            time.strftime("%H:%M:%S", time.localtime(self.projection.since_wall)) if self.projection.since_wall else ""
        )
        return InvalidTransition(verdict.command, state, since, verdict.allowed, verdict.reason, since_wall=wall)

    def _refuse(self, command: str, error: TorporError) -> None:
        # Bounded so that a refusal of oversized input (a huge tag name) is still logged, not EventTooLarge.
        holders = [_clip(str(h), 128) for h in list(getattr(error, "holders", ()))[:16]]
        try:
            self._emit(
                EventKind.REFUSED,
                command=command,
                reason=_clip(str(error), 2048),
                error=type(error).__name__,
                holders=holders,
                state=self.state.value,
            )
        except LogWriteFailed:  # the refusal is what the caller must see; the log says why it lacks it
            logger.exception("torpor: recording the refusal of %s failed", command)
        raise error

    def _check_tags(self, command: str, tags: Sequence[str]) -> None:
        known = set(self.projection.residency) | set(self.memory.usage())
        unknown = [t for t in tags if t not in known]
        if unknown:
            self._refuse(command, UnknownTag(unknown, known))

    def _group_hold(self, undo: Callable[[TorporError], None] | None) -> None:
        """With a group: the local part is prepared; vote, and ``undo`` it (then raise) when a rank failed."""
        if self.group is not None:
            self.group.hold(self, undo)
