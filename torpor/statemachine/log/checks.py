"""What each event kind's payload must hold to be read: the reader's last check on a checksummed line.

A line can pass its checksum and still be unusable: a hand edit, a buggy
writer, a different program writing the same format. :func:`payload_problem`
says what is wrong with an event's payload (or its times) before any reader
folds it, so every reader (replay, follow, the endpoint, the CLI) refuses such
a line with ``LogCorrupted`` naming its file and line instead of failing
later with a ``KeyError`` or an ``OverflowError`` far from the line.

The checks derive from the payload classes of :mod:`torpor.statemachine.core.payloads`:
each declared field is checked by its type (:data:`CHECKS`, one check per type:
byte counts and levels are integers in ``0..2**63-1``, seconds finite
non-negative numbers, tags strings, usages objects of tag to bytes), and a field
without a default must be present. Fields a kind does not declare are free
(future additions); a snapshot's projection is checked by rebuilding it. A
field whose type has no check here fails at import.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from torpor.errors import SchemaIncomplete
from torpor.statemachine.core.events import Event
from torpor.statemachine.core.fields import thaw
from torpor.statemachine.core.kinds import EventKind
from torpor.statemachine.core.payloads import PAYLOADS, Device, ProjectionForm, Released, Tags, Usage
from torpor.statemachine.projection.view import Projection

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


def _bool(value: Any) -> str | None:
    return None if type(value) is bool else f"must be true or false, got {_short(value)}"


def _opt_usage(value: Any) -> str | None:
    return None if value is None else _usage(value)


def _str_list(value: Any) -> str | None:
    if not isinstance(value, tuple | list) or any(type(t) is not str for t in value):
        return f"must be a list of strings, got {_short(value)}"
    return None


def _str_map(value: Any) -> str | None:
    if not isinstance(value, Mapping):
        return f"must be an object, got {type(value).__name__}"
    for key, item in value.items():
        if type(item) is not str:
            return f"[{key!r}] must be a string, got {_short(item)}"
    return None


_Check = Callable[[Any], str | None]

#: The check of each field type the payload classes use.
CHECKS: dict[Any, _Check] = {
    str: _str,
    str | None: _opt_str,
    int: _int,
    int | None: _opt_int,
    float: _num,
    bool: _bool,
    Usage: _usage,
    Usage | None: _opt_usage,
    Tags: _tags,
    tuple[str, ...]: _str_list,
    Device: _device,
    Released: _released,
    Mapping[str, str]: _str_map,
    Mapping[str, Any]: _mapping,
    Mapping[str, Any] | None: _opt_mapping,
    ProjectionForm: _projection,
}


def _checks_of(kind: EventKind) -> dict[str, _Check]:
    checks = {}
    for field in PAYLOADS[kind].fields.values():
        check = CHECKS.get(field.type)
        if check is None:  # a field of a new type: say which check it needs rather than read it unchecked
            msg = (
                f"no payload check for {PAYLOADS[kind].__name__}.{field.name} of type {field.type!r}: add one to CHECKS"
            )
            raise SchemaIncomplete(msg)
        checks[field.name] = check
    return checks


#: Per kind: the names it must carry, and a check per field it declares (required or not).
_REQUIRED: dict[EventKind, frozenset[str]] = {
    kind: frozenset(f.name for f in cls.fields.values() if f.required) for kind, cls in PAYLOADS.items()
}
_CHECKS: dict[EventKind, dict[str, _Check]] = {kind: _checks_of(kind) for kind in PAYLOADS}
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
    for name, value in data.items():
        check = checks.get(name)
        if check is not None and (problem := check(value)) is not None:
            return f"event #{event.seq} ({kind.value}): {name!r} {problem}"
    return None
