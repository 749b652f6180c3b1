"""Events: one immutable record per fact, the source of truth for every projection.

An :class:`Event` is the envelope every part of torpor passes around (sequence
number, times, pid, engine, rank) and its payload, ``event.data``: an instance
of the kind's payload class below (:data:`PAYLOADS`), whose annotated fields
are the kind's schema. Read a payload by its typed attributes
(``event.data.tag`` once ``isinstance(event.data, TagReleased)``, or a
``match`` on the class); it is also a read-only mapping of the fields present,
which is the log's JSON form. Adding a field to a kind is one line in its
class (with a default, so old logs still read) plus the code that reads it.
"""

# No ``from __future__ import annotations``: the payload classes read their evaluated annotations.

import enum
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Annotated, Any

from torpor.statemachine.fields import SCALARS, Field, Payload, freeze, thaw

SCHEMA_VERSION = 1


class EventKind(enum.StrEnum):
    """Every kind of fact the controller records; each has one payload class (:data:`PAYLOADS`)."""

    OPENED = "opened"
    RECOVERED = "recovered"
    SLEEP_REQUESTED = "sleep_requested"
    TAG_BACKED_UP = "tag_backed_up"
    TAG_RELEASED = "tag_released"
    SLEEP_COMPLETED = "sleep_completed"
    SLEEP_ABORTED = "sleep_aborted"
    WAKE_REQUESTED = "wake_requested"
    TAG_RESTORED = "tag_restored"
    TAG_ROLLED_BACK = "tag_rolled_back"
    WAKE_COMPLETED = "wake_completed"
    WAKE_FAILED = "wake_failed"
    TAG_DISCARDED = "tag_discarded"
    DISCARD_COMPLETED = "discard_completed"
    REFUSED = "refused"
    POOL_CREATED = "pool_created"
    GRAPH_CAPTURED = "graph_captured"
    POOL_RELEASED = "pool_released"
    USAGE_OBSERVED = "usage_observed"
    HOOK_DECISION = "hook_decision"
    SNAPSHOT = "snapshot"
    CLOSED = "closed"
    COMMAND_REPEATED = "command_repeated"
    GROUP_AGREED = "group_agreed"


#: Kinds that end (or begin) a transition: the log makes them durable.
BOUNDARY_KINDS: frozenset[EventKind] = frozenset(
    {
        EventKind.OPENED,
        EventKind.RECOVERED,
        EventKind.SLEEP_REQUESTED,
        EventKind.SLEEP_COMPLETED,
        EventKind.SLEEP_ABORTED,
        EventKind.WAKE_REQUESTED,
        EventKind.WAKE_COMPLETED,
        EventKind.WAKE_FAILED,
        EventKind.DISCARD_COMPLETED,
        EventKind.SNAPSHOT,
        EventKind.CLOSED,
        EventKind.GROUP_AGREED,
    }
)

# -- the field types (each has one check in torpor.statemachine.payload) ---------------

#: Bytes per tag, ``{tag: bytes}``.
Usage = Mapping[str, int]
#: Tag names, or None for "all tags".
Tags = tuple[str, ...] | None
#: What stays on the device while asleep (``total``, ``in_use``, ``tagged``, ``untagged``), or None.
Device = Annotated[Mapping[str, int] | None, "signed byte counts"]
#: Tags the memory holds released: ``{tag: {"host": bytes, "discarded": bytes}}``.
Released = Mapping[str, Mapping[str, int]]
#: A projection's JSON form (:meth:`~torpor.statemachine.projection.Projection.to_dict`).
ProjectionForm = Annotated[Mapping[str, Any], "projection"]

_NO_USAGE: Usage = MappingProxyType({})
_NOTHING: Mapping[str, Any] = MappingProxyType({})


# -- one payload class per kind -------------------------------------------------------


class Opened(Payload, kind=EventKind.OPENED):
    """A controller opened: the memory's ``usage``, its class, the state before, the host-memory policy."""

    usage: Usage = _NO_USAGE
    memory: str = ""
    previous_state: str | None = None
    host: Mapping[str, Any] | None = None  # pin, after_wake, budget_bytes


class Recovered(Payload, kind=EventKind.RECOVERED):
    """``recover()`` took the memory as it is after an interrupted transition."""

    usage: Usage = _NO_USAGE
    released: Released = _NOTHING
    interrupted_state: str | None = None
    interrupted_step: str | None = None


class SleepRequested(Payload, kind=EventKind.SLEEP_REQUESTED):
    """A sleep began: its level, its plan ``{tag: offload|discard}``, the usage before."""

    level: int
    plan: Mapping[str, str] = _NOTHING
    usage: Usage = _NO_USAGE


class TagBackedUp(Payload, kind=EventKind.TAG_BACKED_UP):
    """A tag's content copied to the host (before its release)."""

    tag: str
    bytes: int
    seconds: float = 0.0


class TagReleased(Payload, kind=EventKind.TAG_RELEASED):
    """A tag's physical memory released: its content on the host (``offload``) or gone (``discard``)."""

    tag: str
    bytes: int
    action: str = ""
    seconds: float = 0.0


class SleepCompleted(Payload, kind=EventKind.SLEEP_COMPLETED):
    """A sleep finished; ``incomplete`` says why a failed sleep's rollback left it part done."""

    level: int | None = None
    seconds: float = 0.0
    freed: int = 0
    offloaded: int = 0
    discarded: int = 0
    pinned: int | None = None  # pinned host bytes held after the sleep; None: not said
    host_budget: int | None = None
    device: Device = None
    incomplete: str | None = None


class SleepAborted(Payload, kind=EventKind.SLEEP_ABORTED):
    """A sleep failed and was rolled back; ``lost`` names tags whose content may be gone."""

    level: int | None = None
    reason: str | None = None
    error: str | None = None
    seconds: float = 0.0
    usage: Usage = _NO_USAGE
    lost: tuple[str, ...] = ()


class WakeRequested(Payload, kind=EventKind.WAKE_REQUESTED):
    """A wake began: the tags asked for (None: all) and those to restore."""

    tags: Tags = None
    restoring: Tags = None


class TagRestored(Payload, kind=EventKind.TAG_RESTORED):
    """A tag mapped back: from the ``host`` backup, ``fresh`` memory, or by a sleep's ``rollback`` (``lost``)."""

    tag: str
    bytes: int
    source: str = ""
    seconds: float = 0.0
    lost: bool = False


class TagRolledBack(Payload, kind=EventKind.TAG_ROLLED_BACK):
    """A failed wake released a tag it had mapped again (``action`` as in ``tag_released``)."""

    tag: str
    bytes: int
    action: str = ""


class WakeCompleted(Payload, kind=EventKind.WAKE_COMPLETED):
    """A wake finished; ``host_released``: pinned bytes given back by the host-memory policy."""

    tags: Tags = None
    seconds: float = 0.0
    restored: int = 0
    pinned: int | None = None
    host_released: int = 0
    usage: Usage | None = None


class WakeFailed(Payload, kind=EventKind.WAKE_FAILED):
    """A wake failed and was rolled back to asleep."""

    tags: Tags = None
    reason: str | None = None
    error: str | None = None
    seconds: float = 0.0


class TagDiscarded(Payload, kind=EventKind.TAG_DISCARDED):
    """A host backup dropped while asleep."""

    tag: str
    bytes: int


class DiscardCompleted(Payload, kind=EventKind.DISCARD_COMPLETED):
    """A discard ended: the resident tags released without backup; ``error``/``reason`` when part done."""

    tags: Tags = None
    reason: str | None = None
    error: str | None = None
    seconds: float = 0.0


class Refused(Payload, kind=EventKind.REFUSED):
    """A command refused: why, the error class, who holds what, the state it was refused in."""

    command: str = ""
    reason: str | None = None
    error: str | None = None
    holders: tuple[str, ...] = ()
    state: str = ""


class PoolCreated(Payload, kind=EventKind.POOL_CREATED):
    """A CUDA-graph memory pool created."""

    pool: str


class GraphCaptured(Payload, kind=EventKind.GRAPH_CAPTURED):
    """A CUDA graph captured at ``site`` into ``pool``."""

    site: str
    pool: str
    seconds: float = 0.0
    usage: Usage | None = None


class PoolReleased(Payload, kind=EventKind.POOL_RELEASED):
    """The graph pool and its graphs released."""

    pool: str | None = None
    bytes: int = 0
    usage: Usage | None = None


class UsageObserved(Payload, kind=EventKind.USAGE_OBSERVED):
    """The memory's resident bytes per tag, observed."""

    usage: Usage


class HookDecision(Payload, kind=EventKind.HOOK_DECISION):
    """A hook's decision (graph-pool routing, all-reduce, NCCL), recorded from outside."""

    hook: str = ""
    active: bool = False
    detail: str = ""


class Snapshot(Payload, kind=EventKind.SNAPSHOT):
    """The projection at a log rotation: replay starts from here when older segments are gone."""

    projection: ProjectionForm


class Closed(Payload, kind=EventKind.CLOSED):
    """The controller closed, in ``state``."""

    state: str = ""


class CommandRepeated(Payload, kind=EventKind.COMMAND_REPEATED):
    """A retried command whose effect already holds, accepted as a no-op (``idempotent=True``)."""

    command: str = ""
    args: Mapping[str, Any] = _NOTHING
    state: str = ""
    reason: str | None = None


class GroupAgreed(Payload, kind=EventKind.GROUP_AGREED):
    """A TP group's outcome: ``commit`` or ``rollback``, who failed and why, this rank's own vote."""

    group: str
    command: str
    round: int
    size: int
    result: str
    failed: Mapping[str, str] = _NOTHING
    voted: bool = True
    seconds: float = 0.0


#: The payload class of each kind.
PAYLOADS: Mapping[EventKind, type[Payload]] = MappingProxyType(
    {EventKind(cls.kind): cls for cls in Payload.__subclasses__()}
)
if set(PAYLOADS) != set(EventKind):  # a kind without a class would make every reader fail
    _msg = f"event kinds without a payload class: {sorted(set(EventKind) - set(PAYLOADS))}"
    raise ImportError(_msg)


_PAYLOAD_OF: dict[EventKind, type[Payload]] = dict(PAYLOADS)  # a plain dict: one lookup per event built
_set = object.__setattr__


@dataclass(frozen=True, init=False)
class Event:
    """One fact: the envelope and its kind's payload (``data``, read-only; :func:`thaw` gives a plain copy)."""

    kind: EventKind
    seq: int
    wall: float
    mono: float
    pid: int
    engine: str
    rank: int
    data: Payload
    schema: int

    def __init__(
        self,
        kind: EventKind,
        seq: int,
        wall: float,
        mono: float,
        pid: int,
        engine: str,
        rank: int,
        data: Mapping[str, Any] | None = None,
        schema: int = SCHEMA_VERSION,
    ) -> None:
        """The one way an event is built: ``data`` is copied into the kind's payload class, nested values frozen.

        Nothing is checked here: the log's readers check what they decode
        (:func:`~torpor.statemachine.payload.payload_problem`).
        """
        payload = _PAYLOAD_OF[kind]() if data is None else _PAYLOAD_OF[kind](data)  # a copy: the caller's is not shared
        if not SCALARS.issuperset(map(type, dict.values(payload))):  # nested values: freeze them (C-level test first)
            for key, value in dict.items(payload):
                if type(value) not in SCALARS:
                    dict.__setitem__(payload, key, freeze(value))
        # One store of the whole instance dict: a frozen dataclass refuses attribute stores, and
        # nine object.__setattr__ calls (one per field) cost more than the rest of a replayed line.
        _set(
            self,
            "__dict__",
            {
                "kind": kind,
                "seq": seq,
                "wall": wall,
                "mono": mono,
                "pid": pid,
                "engine": engine,
                "rank": rank,
                "data": payload,
                "schema": schema,
            },
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form written to the log."""
        return {
            "schema": self.schema,
            "seq": self.seq,
            "kind": self.kind.value,
            "wall": self.wall,
            "mono": self.mono,
            "pid": self.pid,
            "engine": self.engine,
            "rank": self.rank,
            "data": thaw(self.data),
        }

    def to_json(self) -> str:
        """Compact, key-sorted JSON (the log's line body)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def wall_text(self) -> str:
        """Wall time as ``HH:MM:SS`` local time."""
        return time.strftime("%H:%M:%S", time.localtime(self.wall))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Event":
        """Build an event from its log form (a copy); ``ValueError`` names what is wrong."""
        get = raw.get
        kind: Any = get("kind")
        if not isinstance(kind, str) or kind not in _KINDS:
            msg = f"unknown event kind {kind!r}"
            raise ValueError(msg)
        wall, mono = _float_field("wall", get("wall")), _float_field("mono", get("mono"))
        for name, want in _ENVELOPE.items():
            if type(get(name)) is not want:
                msg = f"field {name!r} must be {want.__name__}, got {get(name)!r}"
                raise ValueError(msg)
        data: Any = get("data", {})
        if not isinstance(data, Mapping):
            msg = f"field 'data' must be an object, got {type(data).__name__}"
            raise ValueError(msg)
        schema = get("schema", SCHEMA_VERSION)
        return cls(
            _KINDS[kind],
            raw["seq"],
            wall,
            mono,
            raw["pid"],
            raw["engine"],
            raw["rank"],
            {str(k): freeze(v) for k, v in data.items()},  # a copy: the caller's objects are not shared
            schema if type(schema) is int else int(schema),
        )


#: Each kind by its name (a dict lookup: faster than ``EventKind(name)``).
KIND_NAMED: Mapping[str, EventKind] = MappingProxyType({k.value: k for k in EventKind})
_KINDS = KIND_NAMED
_ENVELOPE: dict[str, type] = {"seq": int, "pid": int, "rank": int, "engine": str}


def _float_field(name: str, value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    msg = f"field {name!r} must be float, got {value!r}"
    raise ValueError(msg)


def make_event(kind: EventKind, seq: int, engine: str, rank: int, data: Mapping[str, Any]) -> Event:
    """Stamp a new event with the current wall and monotonic time and pid."""
    return Event(kind, seq, time.time(), time.monotonic(), os.getpid(), engine, rank, data)


__all__ = [
    "BOUNDARY_KINDS",
    "KIND_NAMED",
    "PAYLOADS",
    "SCHEMA_VERSION",
    "Closed",
    "CommandRepeated",
    "Device",
    "DiscardCompleted",
    "Event",
    "EventKind",
    "Field",
    "GraphCaptured",
    "GroupAgreed",
    "HookDecision",
    "Opened",
    "Payload",
    "PoolCreated",
    "PoolReleased",
    "ProjectionForm",
    "Recovered",
    "Refused",
    "Released",
    "SleepAborted",
    "SleepCompleted",
    "SleepRequested",
    "Snapshot",
    "TagBackedUp",
    "TagDiscarded",
    "TagReleased",
    "TagRestored",
    "TagRolledBack",
    "Tags",
    "Usage",
    "UsageObserved",
    "WakeCompleted",
    "WakeFailed",
    "WakeRequested",
    "freeze",
    "make_event",
    "thaw",
]
