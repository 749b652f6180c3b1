"""The log's line codec: the only code that knows an event's on-disk form.

A line is one event as compact, key-sorted JSON whose first member is its
checksum, ``{"crc":"xxxxxxxx",...}``: the CRC-32 (8 hex digits) of the line
with that member removed, ending in a newline. :func:`encode_line` writes one;
:func:`decode_line` reads one and names whatever is wrong with it
(``LogCorrupted`` with file and line, ``UnknownSchemaVersion``); the payload is
checked against its kind's class (:func:`~torpor.statemachine.log.checks.payload_problem`).

:func:`decode_lines` is the readers' loop (replay, follow, the endpoint, the
CLI) and the only place with speed tricks: a line in the plain form the writer
writes is checked inline and built with one ``Event(...)`` call; any other line
goes to :func:`decode_line`, so both give the same event or the same error.
Only documented APIs are used (``json.JSONDecoder.raw_decode``, ``zlib.crc32``).
"""

from __future__ import annotations

import json
import math
import operator
import zlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torpor.errors import LogCorrupted, UnknownSchemaVersion
from torpor.statemachine.core.events import KIND_NAMED, SCHEMA_VERSION, Event
from torpor.statemachine.core.kinds import EventKind
from torpor.statemachine.core.payloads import PAYLOADS
from torpor.statemachine.log.checks import _CHECKS, _REQUIRED, MAX_INT, payload_problem

_PREFIX = '{"crc":"'
#: How every event line starts: what tells a torpor log from any other file.
LINE_PREFIX = _PREFIX.encode()
_DECODER = json.JSONDecoder()
_CRC_OPEN = zlib.crc32(b"{")
_HEAD = len(_PREFIX) + 8 + 2  # '{"crc":"' + 8 hex + '",'
_SNAPSHOT = EventKind.SNAPSHOT
_PLAIN = operator.itemgetter("kind", "seq", "wall", "mono", "pid", "engine", "rank", "data")
DEFAULT_MAX_LINE = 64 * 1024
#: The wall times a line may carry: 1970 to the last day of the year 9999, what ``time.localtime`` and
#: ``datetime`` show on every platform (a finite 1e20 passed the checks, then broke every reader that prints it).
MIN_WALL, MAX_WALL = 0.0, 253402214400.0


_NONE = type(None)
#: Field types checked by exact type (and, for numbers, range) in :func:`_payload_ok` itself: the same
#: rule as the type's check in payload.CHECKS. Integers are in 0..2**63-1, floats finite and non-negative.
_SIMPLE: dict[Any, frozenset[type]] = {
    str: frozenset({str}),
    str | None: frozenset({str, _NONE}),
    int: frozenset({int}),
    int | None: frozenset({int, _NONE}),
    float: frozenset({int, float}),
    bool: frozenset({bool}),
}
#: A declared field's rule: the exact types it may have, or None and the check of its type.
_Rule = tuple[frozenset[type] | None, Callable[[Any], str | None]]


def _rules(kind: EventKind) -> tuple[frozenset[str], dict[str, _Rule]]:
    """The names ``kind`` requires and the rule of each field it declares: ``payload_problem``'s, with exact types."""
    fields = PAYLOADS[kind].fields
    return _REQUIRED[kind], {name: (_SIMPLE.get(fields[name].type), check) for name, check in _CHECKS[kind].items()}


def _payload_ok(data: dict[str, Any], required: frozenset[str], rules: dict[str, _Rule]) -> bool:
    """True exactly when ``payload_problem`` finds nothing in ``data``: simple fields by type, no call each.

    ``payload_problem`` stays the reference that names a problem (the slow
    path); the codec's tests check that both agree on every field of every kind.
    """
    if not required <= data.keys():
        return False
    for name, value in data.items():
        rule = rules.get(name)
        if rule is None:  # a field the kind does not declare: free
            continue
        types, check = rule
        if types is None:
            if check(value) is not None:
                return False
            continue
        kind = type(value)
        if kind not in types:
            return False
        if kind is int:
            if not 0 <= value <= MAX_INT:
                return False
        elif kind is float and not 0.0 <= value < math.inf:  # also false for NaN
            return False
    return True


#: The writer's own reference to the check (readers look ``_payload_ok`` up per call: tests count their decodes).
_WRITER_OK = _payload_ok

#: Per kind name (as the log spells it): its kind, the names it requires and its fields' rules.
_FAST: dict[str, tuple[EventKind, frozenset[str], dict[str, _Rule]]] = {
    name: (kind, *_rules(kind)) for name, kind in KIND_NAMED.items()
}


def encode_line(event: Event) -> bytes:
    """One log line for ``event``, with its checksum, ending in a newline."""
    body = event.to_json()
    crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
    return f'{_PREFIX}{crc:08x}",{body[1:]}\n'.encode()


def decode_line(line: bytes, path: str, lineno: int, max_line: int = DEFAULT_MAX_LINE) -> Event:
    """Parse and verify one log line (with or without its newline); raise ``LogCorrupted`` or ``UnknownSchemaVersion``."""
    if len(line) > max_line:
        raise LogCorrupted(path, lineno, f"line is {len(line)} bytes, over the {max_line}-byte limit")
    if line.endswith(b"\n"):
        line = line[:-1]
    if not line.startswith(LINE_PREFIX) or len(line) < _HEAD + 1 or line[_HEAD - 2 : _HEAD] != b'",':
        raise LogCorrupted(path, lineno, "line does not start with a checksum")
    try:
        expected = int(line[len(_PREFIX) : len(_PREFIX) + 8], 16)
    except ValueError:
        raise LogCorrupted(path, lineno, "checksum is not hexadecimal") from None
    if zlib.crc32(memoryview(line)[_HEAD:], _CRC_OPEN) != expected:  # the CRC of "{" + the rest, no copy
        raise LogCorrupted(path, lineno, "checksum mismatch")
    try:
        text = line.decode()
        raw, end = _DECODER.raw_decode(text)  # the whole line: its "crc" member is one more key
    except ValueError as exc:
        raise LogCorrupted(path, lineno, f"not JSON ({exc})") from None
    except RecursionError:
        raise LogCorrupted(path, lineno, "JSON nested too deeply") from None
    if end != len(text):
        raise LogCorrupted(path, lineno, f"text after the JSON object at byte {end}")
    if not isinstance(raw, dict):
        raise LogCorrupted(path, lineno, "line is not a JSON object")
    schema = raw.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:  # not True, not 1.0
        raise UnknownSchemaVersion(path, lineno, schema, SCHEMA_VERSION)
    try:
        event = Event.from_dict(raw)
    except (ValueError, OverflowError) as exc:  # OverflowError: a 400-digit integer where a float belongs
        raise LogCorrupted(path, lineno, str(exc)) from None
    except RecursionError:
        raise LogCorrupted(path, lineno, "event data nested too deeply") from None
    if not MIN_WALL <= event.wall <= MAX_WALL:
        raise LogCorrupted(path, lineno, f"wall time {event.wall!r} is not a time between 1970 and the year 9999")
    problem = payload_problem(event)
    if problem is not None:
        raise LogCorrupted(path, lineno, problem)
    if event.kind is _SNAPSHOT and not _snapshot_ok(event.data):
        since = event.data["projection"].get("since_wall")
        raise LogCorrupted(
            path, lineno, f"snapshot's since_wall {since!r} is not a time between 1970 and the year 9999"
        )
    return event


def _snapshot_ok(data: Any) -> bool:
    """True when a snapshot's projection began at a wall time a reader can show (the time its state began)."""
    since = data["projection"].get("since_wall", 0.0)
    return type(since) in (int, float) and MIN_WALL <= since <= MAX_WALL


def unreadable(event: Event, line: bytes) -> str | None:
    """Why ``line`` (``encode_line(event)``) would not read back as ``event``; None when it would.

    The writer asks before it writes, so that what it accepts every reader
    reads: the fast path's checks on the event first (about a microsecond),
    and only when they do not pass, :func:`decode_line` on the line itself,
    which names the problem (or finds none: a form only the slow path reads).
    """
    _, required, rules = _FAST[event.kind.value]
    if (
        0 <= event.seq <= MAX_INT
        and 0 <= event.pid <= MAX_INT
        and 0 <= event.rank <= MAX_INT
        and MIN_WALL <= event.wall <= MAX_WALL
        and -math.inf < event.mono < math.inf
        and _WRITER_OK(event.data, required, rules)
        and (event.kind is not _SNAPSHOT or _snapshot_ok(event.data))
    ):
        return None
    try:
        decode_line(line, "<event>", event.seq)
    except (LogCorrupted, UnknownSchemaVersion) as exc:
        return str(getattr(exc, "reason", exc))
    return None


def decode_lines(
    lines: Iterable[bytes], path: str, lineno: int = 0, max_line: int = DEFAULT_MAX_LINE
) -> Iterator[Event]:
    """The events of complete lines (no newline), the first being line ``lineno + 1`` of ``path``.

    Each line takes a fast path first: :func:`decode_line`'s checks on a line
    in the writer's plain form (every envelope member present with its exact
    type), inline. Any line the fast path does not accept goes to
    :func:`decode_line` itself, which returns its event or raises the error it
    names, so both paths give the same result.
    """
    raw_decode = _DECODER.raw_decode
    plain = _PLAIN
    fast = _FAST
    payload_ok = _payload_ok
    crc32 = zlib.crc32
    top, inf, min_wall, max_wall = MAX_INT, math.inf, MIN_WALL, MAX_WALL
    snapshot, snapshot_ok = _SNAPSHOT, _snapshot_ok
    for line in lines:
        lineno += 1
        event: Event | None = None
        if len(line) <= max_line and line.startswith(LINE_PREFIX) and line[_HEAD - 2 : _HEAD] == b'",':
            try:
                if crc32(line[_HEAD:], _CRC_OPEN) == int(line[len(_PREFIX) : _HEAD - 2], 16):
                    text = line.decode()
                    raw, end = raw_decode(text, 0)
                    if end == len(text) and type(raw) is dict:
                        schema = raw.get("schema")
                        name, seq, wall, mono, pid, engine, rank, data = plain(raw)
                        kind, required, rules = fast[name]
                        if (
                            schema == SCHEMA_VERSION
                            and type(schema) is int
                            and type(seq) is int
                            and type(wall) is float
                            and type(mono) is float
                            and type(pid) is int
                            and type(engine) is str
                            and type(rank) is int
                            and type(data) is dict
                            and 0 <= seq <= top
                            and 0 <= pid <= top
                            and 0 <= rank <= top
                            and min_wall <= wall <= max_wall
                            and -inf < mono < inf
                            and payload_ok(data, required, rules)
                            and (kind is not snapshot or snapshot_ok(data))
                        ):
                            event = Event(kind, seq, wall, mono, pid, engine, rank, data)
            except Exception:  # decode_line below names what is wrong
                event = None
        if event is None:
            event = decode_line(line, path, lineno, max_line)
        yield event


__all__ = [
    "DEFAULT_MAX_LINE",
    "LINE_PREFIX",
    "MAX_WALL",
    "MIN_WALL",
    "decode_line",
    "decode_lines",
    "encode_line",
    "unreadable",
]
