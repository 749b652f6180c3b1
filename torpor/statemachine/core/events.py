"""Events: one immutable record per fact, the source of truth for every projection.

An :class:`Event` is the envelope every part of torpor passes around (sequence
number, times, pid, engine, rank) and its payload, ``event.data``: an instance
of the kind's payload class (:mod:`torpor.statemachine.core.payloads`), whose
annotated fields are the kind's schema. Read a payload by its typed attributes
(``event.data.tag`` once ``isinstance(event.data, TagReleased)``, or a
``match`` on the class); it is also a read-only mapping of the fields present,
which is the log's JSON form. Adding a field to a kind is one line in its
class (with a default, so old logs still read) plus the code that reads it.
A producer builds the payload by its fields' names (``TagReleased(tag=..., bytes=...)``, checked
by mypy) and :func:`stamp` makes it an event.
The kinds, the payload classes and their base are re-exported here.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torpor.errors import BadEvent
from torpor.statemachine.core.fields import SCALARS, Field, Payload, freeze, thaw
from torpor.statemachine.core.kinds import BOUNDARY_KINDS, KIND_NAMED, SCHEMA_VERSION, EventKind
from torpor.statemachine.core.payloads import (
    PAYLOADS,
    Closed,
    CommandRepeated,
    Device,
    DiscardCompleted,
    GraphCaptured,
    GroupAgreed,
    HookDecision,
    Opened,
    PoolCreated,
    PoolReleased,
    ProjectionForm,
    Recovered,
    Refused,
    Released,
    SleepAborted,
    SleepCompleted,
    SleepRequested,
    Snapshot,
    TagBackedUp,
    TagDiscarded,
    TagReleased,
    TagRestored,
    TagRolledBack,
    Tags,
    Usage,
    UsageObserved,
    WakeCompleted,
    WakeFailed,
    WakeRequested,
)

_PAYLOAD_OF: dict[EventKind, type[Payload]] = dict(PAYLOADS)  # a plain dict: one lookup per event built


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
        (:func:`~torpor.statemachine.log.checks.payload_problem`).
        """
        payload = _PAYLOAD_OF[kind]() if data is None else _PAYLOAD_OF[kind](data)  # a copy: the caller's is not shared
        for value in dict.values(payload):  # nested values: freeze them (scalars, the common case, pass at once)
            if type(value) not in SCALARS:
                for key, item in dict.items(payload):
                    if type(item) not in SCALARS:
                        dict.__setitem__(payload, key, freeze(item))
                break
        # Stored straight into the instance dict: a frozen dataclass refuses attribute stores, and
        # nine object.__setattr__ calls (one per field) cost more than the rest of a replayed line.
        fields = self.__dict__
        fields["kind"] = kind
        fields["seq"] = seq
        fields["wall"] = wall
        fields["mono"] = mono
        fields["pid"] = pid
        fields["engine"] = engine
        fields["rank"] = rank
        fields["data"] = payload
        fields["schema"] = schema

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

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Event:
        """Build an event from its log form (a copy); ``ValueError`` names what is wrong."""
        get = raw.get
        kind: Any = get("kind")
        if not isinstance(kind, str) or kind not in KIND_NAMED:
            msg = f"unknown event kind {kind!r}"
            raise BadEvent(msg)
        wall, mono = _float_field("wall", get("wall")), _float_field("mono", get("mono"))
        for name, want in _ENVELOPE.items():
            if type(get(name)) is not want:
                msg = f"field {name!r} must be {want.__name__}, got {get(name)!r}"
                raise BadEvent(msg)
        data: Any = get("data", {})
        if not isinstance(data, Mapping):
            msg = f"field 'data' must be an object, got {type(data).__name__}"
            raise BadEvent(msg)
        schema = get("schema", SCHEMA_VERSION)
        return cls(
            KIND_NAMED[kind],
            raw["seq"],
            wall,
            mono,
            raw["pid"],
            raw["engine"],
            raw["rank"],
            {str(k): v for k, v in data.items()},  # a copy: Event() freezes (copies) the nested values
            schema if type(schema) is int else int(schema),
        )


_ENVELOPE: dict[str, type] = {"seq": int, "pid": int, "rank": int, "engine": str}


def _float_field(name: str, value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    msg = f"field {name!r} must be float, got {value!r}"
    raise BadEvent(msg)


def stamp(payload: Payload, seq: int, engine: str, rank: int) -> Event:
    """A typed payload (``TagReleased(tag=..., bytes=...)``) as a new event of its kind: the one way torpor builds one.

    Stamped with the current wall and monotonic time and the pid.
    """
    return Event(KIND_NAMED[payload.kind], seq, time.time(), time.monotonic(), os.getpid(), engine, rank, payload)


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
    "stamp",
    "thaw",
]
