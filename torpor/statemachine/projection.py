"""Projections: the current state and per-tag residency as a fold over events.

``replay(log)`` and the live controller compute the same :class:`Projection`
from the same events; the controller never keeps state of its own beside it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torpor.errors import LogCorrupted
from torpor.statemachine.events import Event, EventKind, thaw
from torpor.statemachine.log import read_events
from torpor.statemachine.protocol import TagUsage
from torpor.statemachine.states import ASLEEP, TRANSITIONAL, State


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
    pool: str | None = None
    graphs: list[str] = field(default_factory=list)
    transitions: int = 0
    refusals: int = 0
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
            "pool": self.pool,
            "graphs": list(self.graphs),
            "transitions": self.transitions,
            "refusals": self.refusals,
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
            pool=raw.get("pool"),
            graphs=[str(g) for g in raw.get("graphs", [])],
            transitions=int(raw.get("transitions", 0)),
            refusals=int(raw.get("refusals", 0)),
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
        asleep = set(self.asleep_tags())
        for tag, nbytes in usage.items():
            if tag in asleep:
                continue
            old = self.residency.get(tag)
            self.residency[tag] = TagUsage(int(nbytes), 0, 0, old.allocations if old else 0)

    def apply(self, event: Event) -> Projection:
        """Fold one event into this projection (in place); return self."""
        kind, data = event.kind, event.data
        self.last_seq = event.seq
        self.last_kind = kind  # a StrEnum: equal to its value
        self.engine, self.rank, self.pid = event.engine, event.rank, event.pid
        if kind not in _SIDE_FACTS:  # a refusal or rotation mid-transition must not hide the interrupted step
            self._last_event = event
        if kind in _NO_STATE:
            return self
        if kind is EventKind.SNAPSHOT:
            snap = Projection.from_dict(thaw(data["projection"]))
            snap.last_seq, snap.last_kind = event.seq, kind.value
            self.__dict__.update(snap.__dict__)
        elif kind in (EventKind.OPENED, EventKind.RECOVERED):
            self.residency, self.asleep = {}, set()
            self.graphs, self.pool, self.level, self.resume_from = [], None, None, None
            self._observe(data.get("usage", {}))
            self._set_state(State.AWAKE, event)
        elif kind is EventKind.SLEEP_REQUESTED:
            self._observe(data.get("usage", {}))
            self.resume_from = self.state
            self.level = int(data["level"])
            self._set_state(State.SUSPENDING, event)
        elif kind is EventKind.TAG_RELEASED:
            tag, nbytes = data["tag"], int(data["bytes"])
            allocs = self.residency.get(tag, TagUsage()).allocations
            self.asleep.add(tag)
            if data["action"] == "offload":
                self.residency[tag] = TagUsage(0, nbytes, 0, allocs)
            else:
                self.residency[tag] = TagUsage(0, 0, nbytes, allocs)
        elif kind in (EventKind.TAG_RESTORED, EventKind.TAG_ROLLED_BACK):
            tag, nbytes = data["tag"], int(data["bytes"])
            old = self.residency.get(tag, TagUsage())
            if kind is EventKind.TAG_RESTORED:
                self.asleep.discard(tag)
                self.residency[tag] = TagUsage(nbytes, 0, 0, old.allocations)
            elif data.get("action") == "offload":
                self.asleep.add(tag)
                self.residency[tag] = TagUsage(0, nbytes, 0, old.allocations)
            else:
                self.asleep.add(tag)
                self.residency[tag] = TagUsage(0, 0, nbytes, old.allocations)
        elif kind is EventKind.TAG_DISCARDED:
            tag, nbytes = data["tag"], int(data["bytes"])
            old = self.residency.get(tag, TagUsage())
            self.residency[tag] = TagUsage(0, 0, nbytes, old.allocations)
        elif kind is EventKind.SLEEP_COMPLETED:
            self.pinned_bytes = int(data.get("pinned", self.pinned_bytes))
            self._set_state(State.ASLEEP_L1 if self.level == 1 else State.ASLEEP_L2, event)
        elif kind is EventKind.SLEEP_ABORTED:
            self._set_state(self.resume_from or State.AWAKE, event)
            self.level = None if self.state is State.AWAKE else self.level
        elif kind is EventKind.WAKE_REQUESTED:
            self.resume_from = self.state
            self._set_state(State.RESUMING, event)
        elif kind is EventKind.WAKE_COMPLETED:
            self.pinned_bytes = int(data.get("pinned", self.pinned_bytes))
            if "usage" in data:
                self._observe(data["usage"])
            full = not self.asleep_tags()
            self._set_state(State.AWAKE if full else State.PARTIALLY_AWAKE, event)
            if full:
                self.level = None
        elif kind is EventKind.DISCARD_COMPLETED:
            if self.state is State.AWAKE and self.asleep:
                self._set_state(State.PARTIALLY_AWAKE, event)
        elif kind is EventKind.WAKE_FAILED:
            self._set_state(self.resume_from or State.ASLEEP_L1, event)
        elif kind is EventKind.REFUSED:
            self.refusals += 1
        elif kind is EventKind.POOL_CREATED:
            self.pool = str(data["pool"])
        elif kind is EventKind.GRAPH_CAPTURED:
            self.pool = str(data["pool"])
            self.graphs.append(str(data["site"]))
            self._observe(data.get("usage", {}))
        elif kind is EventKind.POOL_RELEASED:
            self.pool, self.graphs = None, []
            if "usage" in data:
                self._observe(data["usage"])
        elif kind is EventKind.USAGE_OBSERVED:
            self._observe(data["usage"])
        return self


#: Facts that change nothing the projection holds beyond the last event.
_NO_STATE = frozenset({EventKind.TAG_BACKED_UP, EventKind.HOOK_DECISION, EventKind.CLOSED})

#: Facts recorded beside a transition; they never become its ``last_step``.
_SIDE_FACTS = frozenset(
    {EventKind.REFUSED, EventKind.HOOK_DECISION, EventKind.USAGE_OBSERVED, EventKind.SNAPSHOT, EventKind.CLOSED}
)


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
    for event in events:
        try:
            proj.apply(event)
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
