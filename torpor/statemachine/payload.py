"""What each event kind's payload must hold to be read: the reader's last check on a checksummed line.

A line can pass its checksum and still be unusable: a hand edit, a buggy
writer, a different program writing the same format. :func:`payload_problem`
says what is wrong with an event's payload (or its times) before any reader
folds it, so every reader (replay, follow, the endpoint, the CLI) refuses such
a line with ``LogCorrupted`` naming its file and line instead of failing
later with a ``KeyError`` or an ``OverflowError`` far from the line.

The rules follow the payloads documented on :class:`~torpor.statemachine.events.EventKind`:
byte counts are integers in ``0..2**63-1``, seconds finite non-negative numbers,
tags strings, usages objects of tag to bytes. Fields a kind does not name are
free (``hook_decision`` details, future additions); a snapshot's projection is
checked by rebuilding it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from torpor.statemachine.events import Event, EventKind, thaw
from torpor.statemachine.projection import Projection

MAX_INT = 2**63 - 1


def _int(value: Any) -> str | None:
    if type(value) is not int or not 0 <= value <= MAX_INT:
        return f"must be an integer in 0..2**63-1, got {_short(value)}"
    return None


def _num(value: Any) -> str | None:
    kind = type(value)
    if kind is int and 0 <= value <= MAX_INT:
        return None
    if kind is float and math.isfinite(value) and value >= 0.0:
        return None
    return f"must be a finite non-negative number, got {_short(value)}"


def _str(value: Any) -> str | None:
    return None if type(value) is str else f"must be a string, got {_short(value)}"


def _opt_str(value: Any) -> str | None:
    return None if value is None or type(value) is str else f"must be a string or null, got {_short(value)}"


def _usage(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return f"must be an object of tag to bytes, got {type(value).__name__}"
    for nbytes in value.values():
        if type(nbytes) is not int or not 0 <= nbytes <= MAX_INT:
            bad = next(t for t, v in value.items() if v is nbytes)
            return f"[{bad!r}] {_int(nbytes)}"
    return None


def _opt_int(value: Any) -> str | None:
    return None if value is None else _int(value)


def _opt_mapping(value: Any) -> str | None:
    return None if value is None else _mapping(value)


def _device(value: Any) -> str | None:
    """null, or an object of integer byte counts (``total``, ``in_use``, ``tagged``, ``untagged``)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return f"must be an object of byte counts or null, got {type(value).__name__}"
    for name, nbytes in value.items():
        if type(nbytes) is not int or not -MAX_INT <= nbytes <= MAX_INT:
            return f"[{name!r}] must be an integer, got {_short(nbytes)}"
    return None


def _tags(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, tuple | list) or any(type(t) is not str for t in value):
        return f"must be a list of tag names or null, got {_short(value)}"
    return None


def _strings(value: Any) -> str | None:
    if not isinstance(value, tuple | list):
        return f"must be a list, got {type(value).__name__}"
    return None


def _mapping(value: Any) -> str | None:
    return None if isinstance(value, Mapping) else f"must be an object, got {type(value).__name__}"


def _projection(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return f"must be an object, got {type(value).__name__}"
    try:
        Projection.from_dict(thaw(value))
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        return f"is not a projection ({type(exc).__name__}: {exc})"
    return None


def _released(value: Any) -> str | None:
    """``recovered``'s released tags: {tag: {host, discarded}} with byte counts."""
    if not isinstance(value, Mapping):
        return f"must be an object, got {type(value).__name__}"
    for tag, figures in value.items():
        if not isinstance(figures, Mapping):
            return f"[{tag!r}] must be an object, got {type(figures).__name__}"
        for name in ("host", "discarded"):
            problem = _int(figures.get(name))
            if problem:
                return f"[{tag!r}][{name!r}] {problem}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_Check = Callable[[Any], str | None]
# Per kind: (required fields, optional fields), each a name -> check.
_TAG_BYTES: dict[str, _Check] = {"tag": _str, "bytes": _int}
_RULES: dict[EventKind, tuple[dict[str, _Check], dict[str, _Check]]] = {
    EventKind.OPENED: ({}, {"usage": _usage, "memory": _str, "host": _opt_mapping}),
    EventKind.RECOVERED: ({}, {"usage": _usage, "released": _released}),
    EventKind.SLEEP_REQUESTED: ({"level": _int}, {"usage": _usage, "plan": _mapping}),
    EventKind.TAG_BACKED_UP: (_TAG_BYTES, {"seconds": _num}),
    EventKind.TAG_RELEASED: (_TAG_BYTES, {"action": _str, "seconds": _num}),
    EventKind.SLEEP_COMPLETED: (
        {},
        {
            "level": _int,
            "seconds": _num,
            "freed": _int,
            "offloaded": _int,
            "discarded": _int,
            "pinned": _int,
            "host_budget": _opt_int,
            "device": _device,
        },
    ),
    EventKind.SLEEP_ABORTED: ({}, {"level": _int, "seconds": _num, "reason": _opt_str, "error": _opt_str}),
    EventKind.WAKE_REQUESTED: ({}, {"tags": _tags, "restoring": _tags}),
    EventKind.TAG_RESTORED: (_TAG_BYTES, {"source": _str, "seconds": _num}),
    EventKind.TAG_ROLLED_BACK: (_TAG_BYTES, {"action": _str}),
    EventKind.WAKE_COMPLETED: (
        {},
        {"tags": _tags, "seconds": _num, "restored": _int, "pinned": _int, "host_released": _int, "usage": _usage},
    ),
    EventKind.WAKE_FAILED: ({}, {"tags": _tags, "seconds": _num, "reason": _opt_str, "error": _opt_str}),
    EventKind.TAG_DISCARDED: (_TAG_BYTES, {}),
    EventKind.DISCARD_COMPLETED: ({}, {"tags": _tags, "seconds": _num, "reason": _opt_str, "error": _opt_str}),
    EventKind.REFUSED: ({}, {"command": _str, "reason": _opt_str, "error": _opt_str, "holders": _strings}),
    EventKind.POOL_CREATED: ({"pool": _str}, {}),
    EventKind.GRAPH_CAPTURED: ({"site": _str, "pool": _str}, {"seconds": _num, "usage": _usage}),
    EventKind.POOL_RELEASED: ({}, {"pool": _opt_str, "bytes": _int, "usage": _usage}),
    EventKind.USAGE_OBSERVED: ({"usage": _usage}, {}),
    EventKind.HOOK_DECISION: ({}, {}),
    EventKind.SNAPSHOT: ({"projection": _projection}, {}),
    EventKind.CLOSED: ({}, {"state": _str}),
    EventKind.COMMAND_REPEATED: ({}, {"command": _str, "args": _mapping, "state": _str, "reason": _opt_str}),
    EventKind.GROUP_AGREED: (
        {"group": _str, "command": _str, "round": _int, "size": _int, "result": _str},
        {"failed": _mapping, "seconds": _num},
    ),
}
_UNRULED = set(EventKind) - _RULES.keys()
if _UNRULED:  # a new kind without a payload rule would make every reader raise KeyError
    _msg = f"payload rules missing for event kind(s) {sorted(k.value for k in _UNRULED)}"
    raise ImportError(_msg)


#: Per kind: the names it must carry, and a check per field it names (required or not).
_REQUIRED: dict[EventKind, frozenset[str]] = {kind: frozenset(req) for kind, (req, _) in _RULES.items()}
_CHECKS: dict[EventKind, dict[str, _Check]] = {kind: {**req, **opt} for kind, (req, opt) in _RULES.items()}
_isfinite = math.isfinite


def payload_problem(event: Event) -> str | None:
    """What makes ``event`` unreadable (its times or its kind's payload), or None when it is fine."""
    if not (_isfinite(event.wall) and _isfinite(event.mono)):
        return f"event #{event.seq} has a non-finite time (wall {event.wall!r}, mono {event.mono!r})"
    if not (0 <= event.seq <= MAX_INT and 0 <= event.pid <= MAX_INT and 0 <= event.rank <= MAX_INT):
        return f"event #{_short(event.seq)} has a sequence number, pid or rank outside 0..2**63-1"
    data = event.data
    kind = event.kind
    required = _REQUIRED[kind]
    if required and not required <= data.keys():
        missing = sorted(required - data.keys())[0]
        return f"event #{event.seq} ({kind.value}) lacks its {missing!r} field"
    checks = _CHECKS[kind]
    if checks:
        for name, value in data.items():
            check = checks.get(name)
            if check is not None and (problem := check(value)) is not None:
                return f"event #{event.seq} ({kind.value}): {name!r} {problem}"
    return None
