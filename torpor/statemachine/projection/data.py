"""The projection's data: what the events say about one engine rank, its queries and its JSON form.

:class:`~torpor.statemachine.projection.view.Projection` adds the fold
(``apply``); the per-kind steps that change these fields are in
:mod:`torpor.statemachine.projection.fold`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from torpor.statemachine.core.events import (
    DiscardCompleted,
    Event,
    SleepAborted,
    SleepCompleted,
    SleepRequested,
    TagBackedUp,
    TagDiscarded,
    TagReleased,
    TagRestored,
    TagRolledBack,
    WakeCompleted,
    WakeFailed,
    WakeRequested,
    thaw,
)
from torpor.statemachine.core.protocol import TagUsage
from torpor.statemachine.core.states import TRANSITIONAL, State

#: How many capture sites a projection (and so a rotation snapshot) keeps: the most recent ones.
#: ``graph_count`` counts them all; vLLM's piecewise capture makes thousands.
MAX_GRAPH_SITES = 64


@dataclass
class ProjectionData:
    """What the events say about one engine rank right now."""

    state: State = State.AWAKE
    since: int = 0
    since_wall: float = 0.0
    last_seq: int = 0
    last_kind: str = ""
    last_wall: float = 0.0  # the last event's wall time (a closed rank is dated from it)
    engine: str = ""
    rank: int = 0
    pid: int = 0
    level: int | None = None
    resume_from: State | None = None
    residency: dict[str, TagUsage] = field(default_factory=dict)
    asleep: set[str] = field(default_factory=set)
    kept: dict[str, int] = field(default_factory=dict)  # released tags: tracked bytes kept on the host (not ``host``)
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

    @property
    def closed(self) -> bool:
        """True when the last event is ``closed``: the engine closed its controller, a clean end."""
        return self.last_kind == "closed"

    @property
    def shown_state(self) -> str:
        """The state every reader shows: ``closed`` after a clean close, else the machine's state (``state``)."""
        return "closed" if self.closed else self.state.value

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
            "state": self.shown_state,
            "machine_state": self.state.value,
            "closed": self.closed,
            "since": self.since,
            "since_wall": self.since_wall,
            "last_seq": self.last_seq,
            "last_kind": self.last_kind,
            "last_wall": self.last_wall,
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
            "kept": dict(sorted(self.kept.items())),
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
    def from_dict(cls, raw: Mapping[str, Any]) -> Self:
        """Inverse of :meth:`to_dict` (snapshot events)."""
        resume = raw.get("resume_from")
        return cls(
            state=State(raw.get("machine_state") or raw["state"]),  # "state" is "closed" after a close
            since=int(raw["since"]),
            since_wall=float(raw.get("since_wall", 0.0)),
            last_seq=int(raw["last_seq"]),
            last_kind=str(raw.get("last_kind", "")),
            # a snapshot's own wall time replaces it (fold); a value no reader can show is not fatal here
            last_wall=float(raw["last_wall"]) if type(raw.get("last_wall")) in (int, float) else 0.0,
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
            kept={str(t): int(n) for t, n in dict(raw.get("kept", {})).items()},
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

    # -- what the fold steps change (torpor.statemachine.projection.fold) --------------------

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
            residency[tag] = interned_usage(int(nbytes), 0, 0, old.allocations if old is not None else 0)

    def _count(self, allocations: Mapping[str, Any]) -> None:
        """Take the number of allocations per tag from an event that carries them (``allocations``)."""
        residency = self.residency
        for tag, count in allocations.items():
            old = residency.get(tag)
            if old is None:
                residency[tag] = interned_usage(0, 0, 0, int(count))
            else:
                residency[tag] = interned_usage(old.resident, old.host, old.discarded, int(count))


_USAGES: dict[tuple[int, int, int, int], TagUsage] = {}
_MAX_USAGES = 4096


def interned_usage(resident: int, host: int, discarded: int, allocations: int) -> TagUsage:
    """A TagUsage with these figures; equal ones are shared (frozen values, mostly the same few in a replay)."""
    key = (resident, host, discarded, allocations)
    usage = _USAGES.get(key)
    if usage is None:
        if len(_USAGES) >= _MAX_USAGES:
            _USAGES.clear()
        usage = _USAGES[key] = TagUsage(resident, host, discarded, allocations)
    return usage


def _describe(event: Event) -> str:
    """``#seq kind`` and what the step was about: its tag, its level, or the tags it woke."""
    d = event.data
    detail = ""
    match d:
        case TagBackedUp() | TagReleased() | TagRestored() | TagRolledBack() | TagDiscarded():
            detail = f" {d.tag}"
        case SleepRequested():
            detail = f" level {d.level}"
        case SleepCompleted() | SleepAborted() if d.level is not None:
            detail = f" level {d.level}"
        case WakeRequested() | WakeCompleted() | WakeFailed() | DiscardCompleted():
            detail = f" {d.tags}" if d.tags is not None else " all"
    return f"#{event.seq} {event.kind.value}{detail}"
