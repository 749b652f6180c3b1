"""The command gate: one command at a time, the transition guard, refusals recorded with a reason, idempotent no-ops.

Every command of :class:`~torpor.statemachine.controller.SleepController`
enters through :meth:`CommandGate._command` (serialized, never queued: a second
one is refused with ``CommandInFlight``; a closed controller raises
``ControllerClosed``), is checked against the transition table
(:func:`~torpor.statemachine.states.decide`, and nothing else decides whether a
state accepts a command), and leaves through :meth:`CommandGate._refuse` (a
``refused`` event, then the error) or :meth:`CommandGate._repeated` (a
``command_repeated`` no-op) when it does nothing.

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
from torpor.statemachine.base import ControllerBase, _clip, logger
from torpor.statemachine.events import EventKind
from torpor.statemachine.projection import Projection
from torpor.statemachine.states import Verdict, decide


class CommandGate(ControllerBase):
    """The entry and the refusals every command goes through."""

    @contextmanager
    def _command(self, name: str, **args: Any) -> Iterator[None]:
        if self._closed_at:
            raise ControllerClosed(name, self.engine, self.rank, self._closed_at)
        if not self._command_lock.acquire(blocking=False):
            self._refuse(name, CommandInFlight(name, self._in_flight, self.state.value))
        try:
            if self._closed_at:  # closed while this command waited for nothing: close() held the lock
                raise ControllerClosed(name, self.engine, self.rank, self._closed_at)
            self._owner = threading.get_ident()
            self._in_flight = f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
            verdict = decide(self.state, name)
            if verdict.error is NotRecovered:  # before any argument is read: the memory is unknown
                self._refuse(name, self._refusal(verdict))
            yield
        finally:
            self._in_flight = ""
            self._owner = None
            self._command_lock.release()

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
