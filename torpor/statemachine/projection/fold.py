"""The fold's steps: one small function per event kind, in a table built for every kind.

Each step changes a :class:`~torpor.statemachine.projection.data.ProjectionData`
in place from one event's typed payload (its kind's class); :data:`STEPS` says per kind whether it is a
side fact (never a transition's ``last_step``) and which step it runs (None:
the kind changes nothing beyond the last event). A kind missing from the table
fails at import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torpor.statemachine.core.events import (
    DiscardCompleted,
    Event,
    EventKind,
    GraphCaptured,
    GroupAgreed,
    Opened,
    PoolCreated,
    PoolReleased,
    Recovered,
    Refused,
    SleepAborted,
    SleepCompleted,
    SleepRequested,
    Snapshot,
    TagDiscarded,
    TagReleased,
    TagRestored,
    TagRolledBack,
    Usage,
    UsageObserved,
    WakeCompleted,
    WakeFailed,
    WakeRequested,
    thaw,
)
from torpor.statemachine.core.states import State
from torpor.statemachine.projection.data import MAX_GRAPH_SITES, ProjectionData, interned_usage


def _snapshot(p: ProjectionData, event: Event, d: Snapshot) -> None:
    snap = type(p).from_dict(thaw(d.projection))
    snap.last_seq, snap.last_kind, snap.last_wall = event.seq, event.kind.value, event.wall
    p.__dict__.update(snap.__dict__)


def _start_clean(p: ProjectionData, usage: Usage) -> None:
    """What ``opened`` and ``recovered`` share: forget the tags, pool and graphs; take the memory's ``usage``."""
    p.residency, p.asleep = {}, set()
    p.graphs, p.graph_count, p.pool, p.level, p.resume_from = [], 0, None, None, None
    p._observe(usage)


def _opened(p: ProjectionData, event: Event, d: Opened) -> None:
    _start_clean(p, d.usage)
    p._count(d.allocations)
    if d.host is not None:
        p.host_policy = thaw(d.host)
    p._set_state(State.AWAKE, event)


def _recovered(p: ProjectionData, event: Event, d: Recovered) -> None:
    """Start clean from the memory as it is: resident tags from ``usage``, released ones from ``released``."""
    _start_clean(p, d.usage)
    for tag, figures in d.released.items():
        old = p.residency.get(tag)
        allocs = old.allocations if old is not None else 0
        p.residency[tag] = interned_usage(0, int(figures["host"]), int(figures["discarded"]), allocs)
        p.asleep.add(tag)
    p._set_state(State.PARTIALLY_AWAKE if p.asleep else State.AWAKE, event)


def _sleep_requested(p: ProjectionData, event: Event, d: SleepRequested) -> None:
    p._observe(d.usage)
    p._count(d.allocations)
    p.resume_from = p.state
    p.level = int(d.level)
    p._set_state(State.SUSPENDING, event)


def _tag_released(p: ProjectionData, event: Event, d: TagReleased | TagRolledBack) -> None:
    """A tag released, or put back to sleep by a wake's rollback: on the host when offloaded, else discarded."""
    tag, nbytes = d.tag, d.bytes
    old = p.residency.get(tag)
    allocs = old.allocations if old is not None else 0
    p.asleep.add(tag)
    if d.action == "offload":
        p.residency[tag] = interned_usage(0, nbytes, 0, allocs)
    else:
        p.residency[tag] = interned_usage(0, 0, nbytes, allocs)
    if isinstance(d, TagReleased):  # a rollback's re-release leaves the kept copy as it was
        if d.kept:
            p.kept[tag] = d.kept
        else:
            p.kept.pop(tag, None)


def _tag_restored(p: ProjectionData, event: Event, d: TagRestored) -> None:
    tag = d.tag
    old = p.residency.get(tag)
    p.asleep.discard(tag)
    p.residency[tag] = interned_usage(d.bytes, 0, 0, old.allocations if old is not None else 0)
    p.kept.pop(tag, None)


def _tag_discarded(p: ProjectionData, event: Event, d: TagDiscarded) -> None:
    tag = d.tag
    old = p.residency.get(tag)
    p.residency[tag] = interned_usage(0, 0, d.bytes, old.allocations if old is not None else 0)


def _sleep_completed(p: ProjectionData, event: Event, d: SleepCompleted) -> None:
    if d.pinned is not None:
        p.pinned_bytes = d.pinned
    if d.device is not None:  # what stayed on the device while asleep
        p.device_asleep = {str(k): int(v) for k, v in d.device.items()}
    p._set_state(State.ASLEEP_L1 if p.level == 1 else State.ASLEEP_L2, event)


def _sleep_aborted(p: ProjectionData, event: Event, d: SleepAborted) -> None:
    p._set_state(p.resume_from or State.AWAKE, event)
    p.level = None if p.state is State.AWAKE else p.level


def _wake_requested(p: ProjectionData, event: Event, d: WakeRequested) -> None:
    p.resume_from = p.state
    p._set_state(State.RESUMING, event)


def _wake_completed(p: ProjectionData, event: Event, d: WakeCompleted) -> None:
    if d.pinned is not None:
        p.pinned_bytes = d.pinned
    if d.usage is not None:
        p._observe(d.usage)
    full = not p.asleep
    p._set_state(State.AWAKE if full else State.PARTIALLY_AWAKE, event)
    if full:
        p.level = None


def _discard_completed(p: ProjectionData, event: Event, d: DiscardCompleted) -> None:
    if p.state is State.AWAKE and p.asleep:
        p._set_state(State.PARTIALLY_AWAKE, event)


def _wake_failed(p: ProjectionData, event: Event, d: WakeFailed) -> None:
    p._set_state(p.resume_from or State.ASLEEP_L1, event)


def _refused(p: ProjectionData, event: Event, d: Refused) -> None:
    p.refusals += 1


def _pool_created(p: ProjectionData, event: Event, d: PoolCreated) -> None:
    p.pool = d.pool


def _graph_captured(p: ProjectionData, event: Event, d: GraphCaptured) -> None:
    p.pool = d.pool
    p.graphs.append(d.site)
    p.graph_count += 1
    if len(p.graphs) > MAX_GRAPH_SITES:
        del p.graphs[0]
    if d.usage is not None:
        p._observe(d.usage)


def _pool_released(p: ProjectionData, event: Event, d: PoolReleased) -> None:
    p.pool, p.graphs, p.graph_count = None, [], 0
    if d.usage is not None:
        p._observe(d.usage)


def _usage_observed(p: ProjectionData, event: Event, d: UsageObserved) -> None:
    p._observe(d.usage)
    p._count(d.allocations)


def _group_agreed(p: ProjectionData, event: Event, d: GroupAgreed) -> None:
    """The last group outcome this rank took part in (what ``fleet()`` compares across ranks)."""
    p.group = {
        "group": d.group,
        "command": d.command,
        "round": d.round,
        "size": d.size,
        "result": d.result,
        "failed": dict(d.failed),
        "seq": event.seq,
    }


#: A step reads its kind's payload class (``Any`` here: the table maps each kind to the step for its class).
Step = Callable[[ProjectionData, Event, Any], None]

#: Facts that change nothing the projection holds beyond the last event.
NO_STATE = frozenset(
    {
        EventKind.TAG_BACKED_UP,
        EventKind.HOOK_DECISION,
        EventKind.CLOSED,
        EventKind.COMMAND_REPEATED,
        EventKind.BACKUP_ADOPTED,
    }
)

#: Facts recorded beside a transition; they never become its ``last_step``.
SIDE_FACTS = frozenset(
    {
        EventKind.REFUSED,
        EventKind.HOOK_DECISION,
        EventKind.USAGE_OBSERVED,
        EventKind.SNAPSHOT,
        EventKind.CLOSED,
        EventKind.COMMAND_REPEATED,
        EventKind.BACKUP_ADOPTED,
    }
)

STEP_OF: dict[EventKind, Step] = {
    EventKind.SNAPSHOT: _snapshot,
    EventKind.OPENED: _opened,
    EventKind.RECOVERED: _recovered,
    EventKind.SLEEP_REQUESTED: _sleep_requested,
    EventKind.TAG_RELEASED: _tag_released,
    EventKind.TAG_RESTORED: _tag_restored,
    EventKind.TAG_ROLLED_BACK: _tag_released,
    EventKind.TAG_DISCARDED: _tag_discarded,
    EventKind.SLEEP_COMPLETED: _sleep_completed,
    EventKind.SLEEP_ABORTED: _sleep_aborted,
    EventKind.WAKE_REQUESTED: _wake_requested,
    EventKind.WAKE_COMPLETED: _wake_completed,
    EventKind.DISCARD_COMPLETED: _discard_completed,
    EventKind.WAKE_FAILED: _wake_failed,
    EventKind.REFUSED: _refused,
    EventKind.POOL_CREATED: _pool_created,
    EventKind.GRAPH_CAPTURED: _graph_captured,
    EventKind.POOL_RELEASED: _pool_released,
    EventKind.USAGE_OBSERVED: _usage_observed,
    EventKind.GROUP_AGREED: _group_agreed,
}

#: Per kind: (a side fact?, its step or None when it changes no state). Every kind has an entry.
STEPS: dict[EventKind, tuple[bool, Step | None]] = {
    kind: (kind in SIDE_FACTS, None if kind in NO_STATE else STEP_OF[kind]) for kind in EventKind
}
