"""Projections: the current state and per-tag residency as a fold over events.

``replay(log)`` and the live controller compute the same :class:`Projection`
from the same events; the controller never keeps state of its own beside it.
The fields, queries and JSON form are in
:mod:`~torpor.statemachine.projection.data`; the step each event kind runs
is in :mod:`~torpor.statemachine.projection.fold`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torpor.errors import LogCorrupted
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.core.states import ASLEEP, State
from torpor.statemachine.projection.data import MAX_GRAPH_SITES, ProjectionData
from torpor.statemachine.projection.fold import NO_STATE as _NO_STATE
from torpor.statemachine.projection.fold import STEPS as _STEPS

__all__ = ["MAX_GRAPH_SITES", "_NO_STATE", "_STEPS", "Projection", "follow_on", "is_asleep", "project"]


class Projection(ProjectionData):
    """What the events say about one engine rank right now."""

    def apply(self, event: Event) -> Projection:
        """Fold one event into this projection (in place); return self."""
        kind = event.kind
        self.last_seq = event.seq
        self.last_kind = kind  # a StrEnum: equal to its value
        self.last_wall = event.wall
        self.engine = event.engine
        self.rank = event.rank
        self.pid = event.pid
        side_fact, step = _STEPS[kind]
        if not side_fact:  # a refusal or rotation mid-transition must not hide the interrupted step
            self._last_event = event
        if step is not None:
            step(self, event, event.data)
        return self


# -- folding a sequence of events --------------------------------------------------


def project(events: Iterable[Event], start: Projection | None = None, where: str = "events") -> Projection:
    """Fold ``events`` into a projection (a fresh one unless ``start`` is given).

    An event whose payload does not fit its kind (a checksummed line from a
    buggy writer or a hand edit) raises ``LogCorrupted`` naming its number.
    """
    proj = start or Projection()
    apply = proj.apply
    for event in events:
        try:
            apply(event)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            reason = f"event #{event.seq} ({event.kind.value}) has a malformed payload: {type(exc).__name__}: {exc}"
            raise LogCorrupted(where, event.seq, reason) from None
    return proj


def is_asleep(state: State) -> bool:
    """True for asleep_l1 and asleep_l2."""
    return state in ASLEEP


def follow_on(proj: Projection, event: Event) -> Projection:
    """Fold one event a follower read into ``proj``; a log started anew (#1, not a snapshot, after others) starts afresh."""
    if event.seq == 1 and event.kind is not EventKind.SNAPSHOT and proj.last_seq:
        proj = Projection()
    return proj.apply(event)
