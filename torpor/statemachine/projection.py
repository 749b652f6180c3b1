"""Projections: the current state and per-tag residency as a fold over events.

``replay(log)`` and the live controller compute the same :class:`Projection`
from the same events; the controller never keeps state of its own beside it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torpor.errors import LogCorrupted
from torpor.statemachine.events import Event, EventKind, thaw
from torpor.statemachine.log import read_events
from torpor.statemachine.protocol import TagUsage
from torpor.statemachine.states import ASLEEP, TRANSITIONAL, State

#: How many capture sites a projection (and so a rotation snapshot) keeps: the most recent ones.
#: ``graph_count`` counts them all; vLLM's piecewise capture makes thousands.
MAX_GRAPH_SITES = 64


@dataclass
class Projection:
    """What the events say about one engine rank right now."""

    state: State = State.AWAKE
    since: int = 0
    since_wall: float = 0.0
    last_seq: int = 0
    last_kind: str = ""
    engine: str = ""
    rank: int = 0
    pid: int = 0
    level: int | None = None
    resume_from: State | None = None
    residency: dict[str, TagUsage] = field(default_factory=dict)
    asleep: set[str] = field(default_factory=set)
    pinned_bytes: int = 0
    host_policy: dict[str, Any] = field(default_factory=dict)
    device_asleep: dict[str, int] = field(default_factory=dict)
    pool: str | None = None
    graphs: list[str] = field(default_factory=list)
    graph_count: int = 0
    transitions: int = 0
    refusals: int = 0
    group: dict[str, Any] | None = None
    _last_step: str = ""
    _last_event: Event | None = field(default=None, repr=False, compare=False)

    @property
    def last_step(self) -> str:
        """The last fact recorded, as ``#SEQ kind detail`` (what was interrupted, for a torn log)."""
        if self._last_event is not None:
            return _describe(self._last_event)
        return self._last_step

    @property
    def interrupted(self) -> bool:
        """True when the events end inside a transition (a crash mid-sleep or mid-wake)."""
        return self.state in TRANSITIONAL

    def asleep_tags(self) -> list[str]:
        """Tags released by a sleep and not restored since (on the host or discarded)."""
        return sorted(self.asleep)

    def resident_tags(self) -> list[str]:
        """Tags that are resident (or empty), i.e. not asleep."""
        asleep = set(self.asleep_tags())
        return sorted(t for t in self.residency if t not in asleep)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (used by snapshots, ``/state`` and ``torpor log replay``)."""
        return {
            "state": self.state.value,
            "since": self.since,
            "since_wall": self.since_wall,
            "last_seq": self.last_seq,
            "last_kind": self.last_kind,
            "engine": self.engine,
            "rank": self.rank,
            "pid": self.pid,
            "level": self.level,
            "resume_from": self.resume_from.value if self.resume_from else None,
            "residency": {
                t: {"resident": u.resident, "host": u.host, "discarded": u.discarded, "allocations": u.allocations}
                for t, u in sorted(self.residency.items())
            },
            "asleep": sorted(self.asleep),
            "pinned_bytes": self.pinned_bytes,
            "host_policy": dict(self.host_policy),
            "device_asleep": dict(self.device_asleep),
            "pool": self.pool,
            "graphs": list(self.graphs),
            "graph_count": self.graph_count,
            "transitions": self.transitions,
            "refusals": self.refusals,
            "group": self.group,
            "interrupted": self.interrupted,
            "last_step": self.last_step,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Projection:
        """Inverse of :meth:`to_dict` (snapshot events)."""
        resume = raw.get("resume_from")
        return cls(
            state=State(raw["state"]),
            since=int(raw["since"]),
            since_wall=float(raw.get("since_wall", 0.0)),
            last_seq=int(raw["last_seq"]),
            last_kind=str(raw.get("last_kind", "")),
            engine=str(raw.get("engine", "")),
            rank=int(raw.get("rank", 0)),
            pid=int(raw.get("pid", 0)),
            level=raw.get("level"),
            resume_from=State(resume) if resume else None,
            residency={
                str(t): TagUsage(int(u["resident"]), int(u["host"]), int(u["discarded"]), int(u.get("allocations", 0)))
                for t, u in dict(raw.get("residency", {})).items()
            },
            asleep={str(t) for t in raw.get("asleep", [])},
            pinned_bytes=int(raw.get("pinned_bytes", 0)),
            host_policy=dict(raw.get("host_policy", {})),
            device_asleep={str(k): int(v) for k, v in dict(raw.get("device_asleep", {})).items()},
            pool=raw.get("pool"),
            graphs=[str(g) for g in raw.get("graphs", [])][-MAX_GRAPH_SITES:],
            graph_count=int(raw.get("graph_count", len(raw.get("graphs", [])))),
            transitions=int(raw.get("transitions", 0)),
            refusals=int(raw.get("refusals", 0)),
            group=thaw(raw["group"]) if raw.get("group") else None,
            _last_step=str(raw.get("last_step", "")),
        )

    # -- the fold -------------------------------------------------------------

    def _set_state(self, state: State, event: Event) -> None:
        if state is not self.state:
            self.transitions += 1
        self.state = state
        self.since = event.seq
        self.since_wall = event.wall

    def _observe(self, usage: Mapping[str, Any]) -> None:
        """Take resident bytes of awake tags from a usage snapshot."""
        asleep, residency = self.asleep, self.residency
        for tag, nbytes in usage.items():
            if tag in asleep:
                continue
            old = residency.get(tag)
            residency[tag] = _usage(int(nbytes), 0, 0, old.allocations if old is not None else 0)

    def apply(self, event: Event) -> Projection:
        """Fold one event into this projection (in place); return self."""
        kind = event.kind
        self.last_seq = event.seq
        self.last_kind = kind  # a StrEnum: equal to its value
        self.engine = event.engine
        self.rank = event.rank
        self.pid = event.pid
        side_fact, step = _STEPS[kind]
        if not side_fact:  # a refusal or rotation mid-transition must not hide the interrupted step
            self._last_event = event
        if step is not None:
            step(self, event, event.data)
        return self


# -- one step per kind (the fold's dispatch table) ---------------------------------


def _snapshot(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    snap = Projection.from_dict(thaw(data["projection"]))
    snap.last_seq, snap.last_kind = event.seq, event.kind.value
    p.__dict__.update(snap.__dict__)


def _opened(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p.residency, p.asleep = {}, set()
    p.graphs, p.graph_count, p.pool, p.level, p.resume_from = [], 0, None, None, None
    p._observe(data.get("usage", {}))
    if data.get("host") is not None:
        p.host_policy = thaw(data["host"])
    p._set_state(State.AWAKE, event)


def _recovered(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    """Start clean from the memory as it is: resident tags from ``usage``, released ones from ``released``."""
    p.residency, p.asleep = {}, set()
    p.graphs, p.graph_count, p.pool, p.level, p.resume_from = [], 0, None, None, None
    p._observe(data.get("usage", {}))
    for tag, figures in dict(data.get("released") or {}).items():
        old = p.residency.get(tag)
        allocs = old.allocations if old is not None else 0
        p.residency[tag] = _usage(0, int(figures["host"]), int(figures["discarded"]), allocs)
        p.asleep.add(tag)
    p._set_state(State.PARTIALLY_AWAKE if p.asleep else State.AWAKE, event)


def _sleep_requested(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p._observe(data.get("usage", {}))
    p.resume_from = p.state
    p.level = int(data["level"])
    p._set_state(State.SUSPENDING, event)


def _tag_released(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    """A tag released, or put back to sleep by a wake's rollback: on the host when offloaded, else discarded."""
    tag, nbytes = data["tag"], int(data["bytes"])
    old = p.residency.get(tag)
    allocs = old.allocations if old is not None else 0
    p.asleep.add(tag)
    if data.get("action") == "offload":
        p.residency[tag] = _usage(0, nbytes, 0, allocs)
    else:
        p.residency[tag] = _usage(0, 0, nbytes, allocs)


def _tag_restored(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    tag, nbytes = data["tag"], int(data["bytes"])
    old = p.residency.get(tag)
    p.asleep.discard(tag)
    p.residency[tag] = _usage(nbytes, 0, 0, old.allocations if old is not None else 0)


def _tag_discarded(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    tag, nbytes = data["tag"], int(data["bytes"])
    old = p.residency.get(tag)
    p.residency[tag] = _usage(0, 0, nbytes, old.allocations if old is not None else 0)


def _sleep_completed(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p.pinned_bytes = int(data.get("pinned", p.pinned_bytes))
    if data.get("device") is not None:  # what stayed on the device while asleep
        p.device_asleep = {str(k): int(v) for k, v in data["device"].items()}
    p._set_state(State.ASLEEP_L1 if p.level == 1 else State.ASLEEP_L2, event)


def _sleep_aborted(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p._set_state(p.resume_from or State.AWAKE, event)
    p.level = None if p.state is State.AWAKE else p.level


def _wake_requested(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p.resume_from = p.state
    p._set_state(State.RESUMING, event)


def _wake_completed(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p.pinned_bytes = int(data.get("pinned", p.pinned_bytes))
    if "usage" in data:
        p._observe(data["usage"])
    full = not p.asleep
    p._set_state(State.AWAKE if full else State.PARTIALLY_AWAKE, event)
    if full:
        p.level = None


def _discard_completed(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    if p.state is State.AWAKE and p.asleep:
        p._set_state(State.PARTIALLY_AWAKE, event)


def _wake_failed(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p._set_state(p.resume_from or State.ASLEEP_L1, event)


def _refused(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p.refusals += 1


def _pool_created(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p.pool = str(data["pool"])


def _graph_captured(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p.pool = str(data["pool"])
    p.graphs.append(str(data["site"]))
    p.graph_count += 1
    if len(p.graphs) > MAX_GRAPH_SITES:
        del p.graphs[0]
    p._observe(data.get("usage", {}))


def _pool_released(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p.pool, p.graphs, p.graph_count = None, [], 0
    if "usage" in data:
        p._observe(data["usage"])


def _usage_observed(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    p._observe(data["usage"])


def _group_agreed(p: Projection, event: Event, data: Mapping[str, Any]) -> None:
    """The last group outcome this rank took part in (what ``fleet()`` compares across ranks)."""
    p.group = {
        "group": str(data["group"]),
        "command": str(data["command"]),
        "round": int(data["round"]),
        "size": int(data["size"]),
        "result": str(data["result"]),
        "failed": {str(r): str(why) for r, why in dict(data.get("failed", {})).items()},
        "seq": event.seq,
    }


_Step = Callable[[Projection, Event, Mapping[str, Any]], None]

#: Facts that change nothing the projection holds beyond the last event.
_NO_STATE = frozenset({EventKind.TAG_BACKED_UP, EventKind.HOOK_DECISION, EventKind.CLOSED, EventKind.COMMAND_REPEATED})

#: Facts recorded beside a transition; they never become its ``last_step``.
_SIDE_FACTS = frozenset(
    {
        EventKind.REFUSED,
        EventKind.HOOK_DECISION,
        EventKind.USAGE_OBSERVED,
        EventKind.SNAPSHOT,
        EventKind.CLOSED,
        EventKind.COMMAND_REPEATED,
    }
)

_STEP_OF: dict[EventKind, _Step] = {
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
_STEPS: dict[EventKind, tuple[bool, _Step | None]] = {
    kind: (kind in _SIDE_FACTS, None if kind in _NO_STATE else _STEP_OF[kind]) for kind in EventKind
}

_USAGES: dict[tuple[int, int, int, int], TagUsage] = {}
_MAX_USAGES = 4096


def _usage(resident: int, host: int, discarded: int, allocations: int) -> TagUsage:
    """A TagUsage with these figures; equal ones are shared (frozen values, mostly the same few in a replay)."""
    key = (resident, host, discarded, allocations)
    usage = _USAGES.get(key)
    if usage is None:
        if len(_USAGES) >= _MAX_USAGES:
            _USAGES.clear()
        usage = _USAGES[key] = TagUsage(resident, host, discarded, allocations)
    return usage


def _describe(event: Event) -> str:
    d = event.data
    detail = ""
    if "tag" in d:
        detail = f" {d['tag']}"
    elif "level" in d:
        detail = f" level {d['level']}"
    elif "tags" in d:
        detail = f" {d['tags']}" if d["tags"] is not None else " all"
    return f"#{event.seq} {event.kind.value}{detail}"


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


def replay(source: str | os.PathLike[str] | Iterable[Event]) -> Projection:
    """The projection of a log file (all its segments) or of an iterable of events."""
    if isinstance(source, str | os.PathLike):
        return project(read_events(source), where=str(source))
    return project(source)


def is_asleep(state: State) -> bool:
    """True for asleep_l1 and asleep_l2."""
    return state in ASLEEP
