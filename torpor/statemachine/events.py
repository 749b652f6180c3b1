"""Events: one immutable record per fact, the source of truth for every projection."""

from __future__ import annotations

import enum
import json
import operator
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

SCHEMA_VERSION = 1


class EventKind(enum.StrEnum):
    """Every kind of fact the controller records.

    Payload (``Event.data``) per kind:

    - ``opened``: ``usage`` {tag: resident bytes}, ``memory`` (its class), ``previous_state``,
      ``host`` (the host-memory policy: ``pin``, ``after_wake``, ``budget_bytes``)
    - ``recovered``: ``usage``, ``released`` {tag: {host, discarded}} (tags the memory holds released), ``interrupted_state``,
      ``interrupted_step``
    - ``sleep_requested``: ``level``, ``plan`` {tag: offload|discard}, ``usage``
    - ``tag_backed_up``: ``tag``, ``bytes``, ``seconds``
    - ``tag_released``: ``tag``, ``bytes``, ``action`` (offload|discard), ``seconds``
    - ``sleep_completed``: ``level``, ``seconds``, ``freed``, ``offloaded``, ``discarded``, ``pinned``,
      ``host_budget``, ``device`` (what stays on the device while asleep: ``total``, ``in_use``,
      ``tagged`` (torpor's tags still mapped), ``untagged`` (context, libraries, torch's default pool);
      null when the memory cannot say)
    - ``sleep_aborted``: ``level``, ``reason``, ``error``, ``seconds``
    - ``wake_requested``: ``tags`` (requested, or null for all), ``restoring``
    - ``tag_restored``: ``tag``, ``bytes``, ``source`` (host|fresh), ``seconds``
    - ``tag_rolled_back``: ``tag``, ``bytes``, ``action``
    - ``wake_completed``: ``tags``, ``seconds``, ``restored``, ``pinned``, ``host_released`` (pinned
      bytes given back after the wake by the host-memory policy)
    - ``wake_failed``: ``tags``, ``reason``, ``error``, ``seconds``
    - ``tag_discarded``: ``tag``, ``bytes`` (a host backup dropped while asleep)
    - ``discard_completed``: ``tags`` (resident tags released without backup), ``error``, ``reason``, ``seconds``
    - ``refused``: ``command``, ``reason``, ``error``, ``holders``
    - ``pool_created``: ``pool``
    - ``graph_captured``: ``site``, ``pool``, ``seconds``, ``usage``
    - ``pool_released``: ``pool``, ``bytes``
    - ``usage_observed``: ``usage``
    - ``hook_decision``: ``hook``, ``active``, ``detail`` (free-form strings)
    - ``snapshot``: ``projection`` (the projection at a log rotation)
    - ``closed``: ``state``
    - ``command_repeated``: ``command``, ``args``, ``state``, ``reason`` (a retried command whose effect
      already holds, accepted as a no-op: ``sleep``/``wake`` with ``idempotent=True``, as the vLLM backend calls them)
    - ``group_agreed``: ``group``, ``command``, ``round``, ``size``, ``result`` (commit|rollback),
      ``failed`` {rank: why}, ``voted`` (this rank's own vote: ok or not), ``seconds``
    """

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

_KINDS = {k.value: k for k in EventKind}
_FIELDS: dict[str, type] = {"seq": int, "wall": float, "mono": float, "pid": int, "engine": str, "rank": int}


def _freeze_parsed(value: dict[str, Any]) -> MappingProxyType[str, Any]:
    """Freeze a dict fresh from ``json.loads`` in place (nobody else holds it): no copy of the top level."""
    for key, item in value.items():
        kind = type(item)
        if kind is dict:
            value[key] = _freeze_parsed(item)
        elif kind is list:
            value[key] = tuple(_freeze(v) for v in item)
    return MappingProxyType(value)


def _freeze(value: Any) -> Any:
    kind = type(value)
    if kind is dict or (kind is not str and isinstance(value, Mapping)):
        return MappingProxyType({str(k): _freeze(v) for k, v in value.items()})
    if kind is list or kind is tuple:
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Turn a frozen payload back into plain JSON-ready dicts and lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    if isinstance(value, enum.Enum):
        return value.value
    return value


@dataclass(frozen=True, slots=True)
class Event:
    """One fact. ``data`` is read-only; :func:`thaw` gives a plain copy."""

    kind: EventKind
    seq: int
    wall: float
    mono: float
    pid: int
    engine: str
    rank: int
    data: Mapping[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if type(self.data) is not MappingProxyType:  # from_dict hands over data it froze itself
            object.__setattr__(self, "data", _freeze(self.data))

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
    def from_dict(cls, raw: Mapping[str, Any]) -> Event:
        """Build an event from its log form; ``ValueError`` names what is wrong."""
        return cls._from_parsed(dict(raw), copy_data=True)

    @classmethod
    def _from_parsed(cls, raw: dict[str, Any], copy_data: bool = False) -> Event:
        """from_dict for a dict fresh from the JSON decoder: its payload is frozen in place."""
        get = raw.get
        kind: Any = get("kind")
        if not isinstance(kind, str) or kind not in _KINDS:
            msg = f"unknown event kind {kind!r}"
            raise ValueError(msg)
        seq: Any = get("seq")
        wall: Any = get("wall")
        mono: Any = get("mono")
        pid: Any = get("pid")
        engine: Any = get("engine")
        rank: Any = get("rank")
        if type(wall) is not float or type(mono) is not float:
            wall, mono = _float_field("wall", wall), _float_field("mono", mono)
        if type(seq) is not int or type(pid) is not int or type(rank) is not int or type(engine) is not str:
            for name, value in (("seq", seq), ("pid", pid), ("rank", rank), ("engine", engine)):
                if type(value) is not _FIELDS[name]:
                    msg = f"field {name!r} must be {_FIELDS[name].__name__}, got {value!r}"
                    raise ValueError(msg)
        data: Any = get("data", _EMPTY)
        if type(data) is not dict or copy_data or data is _EMPTY:
            if not isinstance(data, dict):
                msg = f"field 'data' must be an object, got {type(data).__name__}"
                raise ValueError(msg)
            data = {str(k): _freeze(v) for k, v in data.items()}  # a copy, nested objects and arrays too
        # else: fresh from the decoder, nobody else holds it: _built freezes it in place
        schema = get("schema", SCHEMA_VERSION)
        if type(schema) is not int:
            schema = int(schema)
        return _built(cls, _KINDS[kind], seq, wall, mono, pid, engine, rank, data, schema)


class _EventBuilder:
    """Event's slot layout without the frozen ``__setattr__``: fills a new event with plain stores.

    A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``
    (nine calls); replay builds one event per line, so :meth:`Event._from_parsed`
    fills one of these and then switches its class to :class:`Event`, which
    CPython allows because the two classes have the same ``__slots__``. Nothing
    else ever sees an ``_EventBuilder``.
    """

    __slots__ = ("data", "engine", "kind", "mono", "pid", "rank", "schema", "seq", "wall")  # Event's, sorted

    def __init__(
        self,
        kind: EventKind,
        seq: int,
        wall: float,
        mono: float,
        pid: int,
        engine: str,
        rank: int,
        data: Mapping[str, Any],
        schema: int,
    ) -> None:
        self.kind = kind
        self.seq = seq
        self.wall = wall
        self.mono = mono
        self.pid = pid
        self.engine = engine
        self.rank = rank
        self.data = data
        self.schema = schema


_EMPTY: dict[str, Any] = {}  # "data" absent: never wrapped, _from_parsed copies it
if sorted(_EventBuilder.__slots__) != sorted(Event.__slots__):  # a field added to Event must be added to the builder
    msg = f"_EventBuilder slots {_EventBuilder.__slots__} differ from Event's {Event.__slots__}"
    raise TypeError(msg)


_LOG_FIELDS = operator.itemgetter("kind", "seq", "wall", "mono", "pid", "engine", "rank", "data")


def plain_event(raw: dict[str, Any]) -> Event | None:
    """The event of a decoded log line in its plain form (what the log writes), else None.

    Plain form: every field present with its exact type (``wall`` and ``mono``
    floats, ``data`` an object), a known kind; the caller has checked the schema.
    It builds the same event as ``Event._from_parsed`` (payload frozen in place);
    for anything else it returns None or raises (KeyError, TypeError), and the
    caller falls back to the full checks, which accept what they can and name
    what is wrong.
    """
    kind, seq, wall, mono, pid, engine, rank, data = _LOG_FIELDS(raw)
    if (
        type(seq) is not int
        or type(wall) is not float
        or type(mono) is not float
        or type(pid) is not int
        or type(engine) is not str
        or type(rank) is not int
        or type(data) is not dict
    ):
        return None
    return _built(Event, _KINDS[kind], seq, wall, mono, pid, engine, rank, data, SCHEMA_VERSION)


def _built(
    cls: type[Event],
    kind: EventKind,
    seq: int,
    wall: float,
    mono: float,
    pid: int,
    engine: str,
    rank: int,
    data: dict[str, Any],
    schema: int,
) -> Event:
    """An event over ``data``, whose nested objects and arrays are frozen in place (the caller owns it)."""
    for key, item in data.items():
        if type(item) is dict:
            data[key] = _freeze_parsed(item)
        elif type(item) is list:
            data[key] = tuple(_freeze(v) for v in item)
    event = _EventBuilder(kind, seq, wall, mono, pid, engine, rank, MappingProxyType(data), schema)
    event.__class__ = cls  # type: ignore[assignment]  # same slots: now an ordinary frozen Event (see _EventBuilder)
    return event  # type: ignore[return-value]


def _float_field(name: str, value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    msg = f"field {name!r} must be float, got {value!r}"
    raise ValueError(msg)


def make_event(kind: EventKind, seq: int, engine: str, rank: int, data: Mapping[str, Any]) -> Event:
    """Stamp a new event with the current wall and monotonic time and pid."""
    return Event(
        kind=kind,
        seq=seq,
        wall=time.time(),
        mono=time.monotonic(),
        pid=os.getpid(),
        engine=engine,
        rank=rank,
        data=data,
    )
