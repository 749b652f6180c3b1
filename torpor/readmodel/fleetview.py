"""The engine-wide view's data: one rank, one group outcome, one engine, every engine; and how ranks merge.

All asleep is ``asleep``, all awake ``awake``, all partially awake
``partially_awake``; anything else is ``transitional``: the rank whose state
changed last leads, and the ranks not in its state are named as lagging. A
rank without a log lags too; a rank whose log cannot be read makes the engine
``unknown``. :func:`torpor.readmodel.ranklogs.fleet` reads the logs into these views.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torpor.errors import NotInFleet
from torpor.statemachine.core.protocol import TagUsage
from torpor.statemachine.core.states import ASLEEP, State

#: Engine-wide states :func:`fleet` reports.
ENGINE_STATES: tuple[str, ...] = ("awake", "asleep", "partially_awake", "transitional", "closed", "unknown")


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall)) if wall else "--:--:--"


@dataclass(frozen=True)
class RankView:
    """One rank as its log tells it. ``state`` is a :class:`State` value, ``closed``, ``unreadable`` or ``no log``."""

    engine: str
    rank: int
    path: Path | None
    state: str
    since: int = 0
    since_wall: float = 0.0
    last_seq: int = 0
    pid: int = 0
    level: int | None = None
    residency: Mapping[str, TagUsage] = field(default_factory=dict)
    error: str | None = None
    group: Mapping[str, Any] | None = None
    pinned_bytes: int = 0
    host_policy: Mapping[str, Any] = field(default_factory=dict)
    device_asleep: Mapping[str, int] = field(default_factory=dict)

    @property
    def asleep(self) -> bool:
        """True in asleep_l1 or asleep_l2."""
        return self.state in (State.ASLEEP_L1.value, State.ASLEEP_L2.value)

    def describe(self) -> str:
        """``rank N (STATE since #SEQ HH:MM:SS)``, or the reason there is no state."""
        if self.error is not None:
            return f"rank {self.rank} ({self.state}: {self.error})"
        if self.path is None:
            return f"rank {self.rank} (no log)"
        return f"rank {self.rank} ({self.state} since #{self.since} {_clock(self.since_wall)})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "rank": self.rank,
            "path": str(self.path) if self.path else None,
            "state": self.state,
            "since": self.since,
            "since_wall": self.since_wall,
            "last_seq": self.last_seq,
            "pid": self.pid,
            "level": self.level,
            "residency": {
                t: {"resident": u.resident, "host": u.host, "discarded": u.discarded, "allocations": u.allocations}
                for t, u in sorted(self.residency.items())
            },
            "error": self.error,
            "group": dict(self.group) if self.group is not None else None,
            "pinned_bytes": self.pinned_bytes,
            "host_policy": dict(self.host_policy),
            "device_asleep": dict(self.device_asleep),
        }


@dataclass(frozen=True)
class GroupView:
    """The ranks' last group outcomes compared: ``consistent``, or which ranks ``differ`` from the rest.

    ``command``, ``round``, ``result`` (commit or rollback) and ``failed``
    (rank -> why) are those of the outcome most ranks recorded (the lowest
    rank's on a tie); a rank differs when its state or its last outcome
    (command number and result) is not the majority's, or it has none.
    """

    name: str
    command: str
    round: int
    result: str
    failed: Mapping[str, str]
    consistent: bool
    differ: tuple[int, ...] = ()

    def describe(self) -> str:
        """One line: the outcome and whether the ranks agree."""
        what = f"group {self.name}: {self.command} #{self.round} {self.result}"
        if self.failed:
            what += f" (failed: {', '.join(f'rank {r}' for r in sorted(self.failed, key=int))})"
        if self.consistent:
            return f"{what}; consistent"
        return f"{what}; split: rank{'s' if len(self.differ) != 1 else ''} {', '.join(map(str, self.differ))} differ"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "command": self.command,
            "round": self.round,
            "result": self.result,
            "failed": dict(self.failed),
            "consistent": self.consistent,
            "differ": list(self.differ),
        }


def group_view(ranks: list[RankView]) -> GroupView | None:
    """Compare the ranks' last group outcomes (None when no rank ran a group command)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    if not any(r.group for r in ranks):
        return None

    def key(r: RankView) -> tuple[Any, ...]:
        g = r.group or {}
        return (r.state, g.get("group"), g.get("round"), g.get("result"))

    counts: dict[tuple[Any, ...], int] = {}
    for r in ranks:
        counts[key(r)] = counts.get(key(r), 0) + 1
    grouped = [r for r in ranks if r.group]
    top = max(counts[key(r)] for r in grouped)
    ref = next(r for r in grouped if counts[key(r)] == top)
    differ = tuple(r.rank for r in ranks if key(r) != key(ref))
    g = ref.group or {}
    return GroupView(
        name=str(g.get("group", "")),
        command=str(g.get("command", "")),
        round=int(g.get("round", 0)),
        result=str(g.get("result", "")),
        failed=dict(g.get("failed", {})),
        consistent=not differ,
        differ=differ,
    )


@dataclass(frozen=True)
class EngineView:
    """One engine's ranks merged.

    ``state`` is one of :data:`ENGINE_STATES`; while ``transitional``,
    ``leader`` is the rank whose state changed last and ``target`` its state,
    and ``lagging`` the ranks not (yet) in it.
    """

    engine: str
    state: str
    ranks: tuple[RankView, ...]
    level: int | None = None
    target: str | None = None
    leader: int | None = None
    lagging: tuple[int, ...] = ()
    group: GroupView | None = None

    @property
    def asleep(self) -> bool:
        """True when every rank is asleep."""
        return self.state == "asleep"

    def matches(self, state: str) -> bool:
        """True when the engine is in ``state``; ``asleep_l1``/``asleep_l2`` also check the level."""
        if state in (State.ASLEEP_L1.value, State.ASLEEP_L2.value):
            return self.state == "asleep" and self.level == int(state[-1])
        return self.state == state

    def summary(self) -> str:
        """One line: the engine-wide state, and the lagging ranks when there are any."""
        n = len(self.ranks)
        head = f"engine {self.engine}: {self.state}"
        if self.state == "asleep":
            head += f" (level {self.level})" if self.level else " (mixed levels)"
        if self.state in ("awake", "asleep", "partially_awake", "closed"):
            since = max(r.since_wall for r in self.ranks)
            return f"{head}, {n} rank{'s' if n != 1 else ''}, since {_clock(since)}"
        lagging = ", ".join(self.rank(r).describe() for r in self.lagging)
        leads = f", {self.rank(self.leader).describe()} leads" if self.leader is not None else ""
        return f"{head}, {n} rank{'s' if n != 1 else ''}{leads}; lagging: {lagging}"

    def rank(self, number: int) -> RankView:
        """The view of rank ``number``."""
        for view in self.ranks:
            if view.rank == number:
                return view
        msg = f"engine {self.engine!r} has no rank {number}; ranks: {', '.join(str(r.rank) for r in self.ranks)}"
        raise NotInFleet(msg)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "engine": self.engine,
            "state": self.state,
            "level": self.level,
            "target": self.target,
            "leader": self.leader,
            "lagging": list(self.lagging),
            "ranks": [r.to_dict() for r in self.ranks],
            "group": self.group.to_dict() if self.group is not None else None,
        }


@dataclass(frozen=True)
class FleetView:
    """Every engine in a log directory. ``state`` merges them the way ranks are merged."""

    directory: Path
    engines: tuple[EngineView, ...]

    @property
    def state(self) -> str:
        """The common state of all engines, or ``transitional`` (``unknown`` if any is unknown)."""
        states = {e.state for e in self.engines}
        if len(states) == 1:
            return states.pop()
        return "unknown" if "unknown" in states else "transitional"

    @property
    def asleep(self) -> bool:
        """True when every rank of every engine is asleep."""
        return self.state == "asleep"

    def engine(self, name: str) -> EngineView:
        """The view of engine ``name``."""
        for view in self.engines:
            if view.engine == name:
                return view
        msg = f"no engine {name!r} in {self.directory}; engines: {', '.join(e.engine for e in self.engines)}"
        raise NotInFleet(msg)

    def lagging(self) -> list[str]:
        """``ENGINE.rankN`` for every lagging rank of every engine."""
        return [f"{e.engine}.rank{r}" for e in self.engines for r in e.lagging]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``torpor status --json``)."""
        return {"directory": str(self.directory), "state": self.state, "engines": [e.to_dict() for e in self.engines]}


def merge(engine: str, ranks: list[RankView]) -> EngineView:
    """Merge one engine's rank views into its engine-wide view (the group view included)."""
    view = _merge(engine, ranks)
    group = group_view(list(view.ranks))
    return view if group is None else replace(view, group=group)


def _merge(engine: str, ranks: list[RankView]) -> EngineView:
    ranks = sorted(ranks, key=lambda r: r.rank)
    unreadable = tuple(r.rank for r in ranks if r.error is not None)
    if unreadable:
        return EngineView(engine, "unknown", tuple(ranks), lagging=unreadable)
    absent = tuple(r.rank for r in ranks if r.path is None)
    present = [r for r in ranks if r.path is not None]
    states = {r.state for r in present}
    if not absent and states <= {s.value for s in ASLEEP}:
        levels = {r.level for r in present}
        return EngineView(engine, "asleep", tuple(ranks), level=levels.pop() if len(levels) == 1 else None)
    if not absent and len(states) == 1:
        return EngineView(engine, states.pop(), tuple(ranks))
    live = [r for r in present if r.state != "closed"] or present
    leader = max(live, key=lambda r: (r.since_wall, r.since))
    target = leader.state
    lagging = tuple(r.rank for r in ranks if r.path is None or r.state != target)
    return EngineView(engine, "transitional", tuple(ranks), target=target, leader=leader.rank, lagging=lagging)
