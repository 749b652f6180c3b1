"""The append-only event log: JSON Lines with a checksum per line.

Each line is one event, ``{"crc":"xxxxxxxx",...}``: the CRC-32 of the line with
the ``"crc"`` member removed. Lines are flushed on every append and fsync'ed at
transition boundaries (configurable). The writer, :class:`EventLog`
(:mod:`torpor.statemachine.logwriter`, re-exported here), opens its files as
:mod:`torpor.statemachine.logfile` describes (0600, no links followed, one
writer per log, never a file that is not a torpor log), and a failed write is
cut back to the last whole line. When the active file passes ``max_bytes`` it is renamed to
``NAME.SEQ`` (SEQ = its first sequence number) and the new file opens with a
``snapshot`` event, so replay stays correct when old segments are pruned
(``keep`` of them are kept). A torn last line (a crash mid-write) is tolerated
with a warning and cut off when the log is reopened for appending; a bad line
anywhere else raises :class:`~torpor.errors.LogCorrupted`. Nothing read from a
log is executed or unpickled: lines are parsed as JSON and validated.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from torpor.errors import LogCorrupted, UnknownSchemaVersion
from torpor.statemachine.events import SCHEMA_VERSION, Event, plain_event
from torpor.statemachine.payload import payload_problem
from torpor.statemachine.projection import Projection, project
from torpor.statemachine.tail import read_file, read_log, segments

logger = logging.getLogger(__name__)

_PREFIX = '{"crc":"'
_PREFIX_B = _PREFIX.encode()
_DECODER = json.JSONDecoder()
# What raw_decode calls (JSONDecoder.__init__ sets it): the fast path calls it directly, one call less per line.
_SCAN: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]
_CRC_OPEN = zlib.crc32(b"{")
_HEAD = len(_PREFIX) + 8 + 2  # '{"crc":"' + 8 hex + '",'
DEFAULT_MAX_LINE = 64 * 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def encode_line(event: Event) -> bytes:
    """One log line for ``event``, with its checksum, ending in a newline."""
    body = event.to_json()
    crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
    return f'{_PREFIX}{crc:08x}",{body[1:]}\n'.encode()


def decode_line(line: bytes, path: str, lineno: int, max_line: int = DEFAULT_MAX_LINE) -> Event:
    """Parse and verify one log line; raise ``LogCorrupted`` or ``UnknownSchemaVersion``."""
    if len(line) > max_line:
        raise LogCorrupted(path, lineno, f"line is {len(line)} bytes, over the {max_line}-byte limit")
    if line.endswith(b"\n"):
        line = line[:-1]
    if not line.startswith(_PREFIX_B) or len(line) < _HEAD + 1 or line[_HEAD - 2 : _HEAD] != b'",':
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
        event = Event._from_parsed(raw)
    except (ValueError, OverflowError) as exc:  # OverflowError: a 400-digit integer where a float belongs
        raise LogCorrupted(path, lineno, str(exc)) from None
    except RecursionError:
        raise LogCorrupted(path, lineno, "event data nested too deeply") from None
    problem = payload_problem(event)
    if problem is not None:
        raise LogCorrupted(path, lineno, problem)
    return event


def decode_lines(
    lines: Iterable[bytes], path: str, lineno: int = 0, max_line: int = DEFAULT_MAX_LINE
) -> Iterator[Event]:
    """The events of complete lines (no newline), the first being line ``lineno + 1`` of ``path``.

    Each line takes a fast path first: the checks of :func:`decode_line` on a
    well-formed line, inline, with the JSON scanner called directly. Any line the
    fast path does not accept goes to :func:`decode_line` itself, which returns
    its event or raises the error it names, so both paths give the same result.
    Every event's payload is checked (:func:`~torpor.statemachine.payload.payload_problem`).
    """
    scan = _SCAN
    plain = plain_event
    crc32 = zlib.crc32
    problem_of = payload_problem
    for line in lines:
        lineno += 1
        event: Event | None = None
        if len(line) <= max_line and line.startswith(_PREFIX_B) and line[_HEAD - 2 : _HEAD] == b'",':
            try:
                if crc32(line[_HEAD:], _CRC_OPEN) == int(line[len(_PREFIX) : _HEAD - 2], 16):
                    text = line.decode()
                    raw, end = scan(text, 0)
                    if end == len(text) and type(raw) is dict:
                        schema = raw.get("schema")
                        if schema == SCHEMA_VERSION and type(schema) is int:
                            event = plain(raw)
                            if event is not None and problem_of(event) is not None:
                                event = None
            except Exception:  # decode_line below names what is wrong
                event = None
        if event is None:
            event = decode_line(line, path, lineno, max_line)
        yield event


def read_events(path: str | os.PathLike[str], max_line: int = DEFAULT_MAX_LINE) -> Iterator[Event]:
    """Every event in the log at ``path`` (all its segments), oldest first (:func:`torpor.statemachine.tail.read_log`).

    Sequence numbers must increase by one; a gap or repeat raises ``LogCorrupted``
    (except at the start of a segment that opens with a snapshot).
    """
    return read_log(path, decode_lines, max_line)


def read_events_file(file: Path, max_line: int = DEFAULT_MAX_LINE) -> Iterator[Event]:
    """Events of one file (one segment) only; a torn last line is tolerated with a warning."""
    return read_file(file, decode_lines, max_line)


def replay(source: str | os.PathLike[str] | Iterable[Event]) -> Projection:
    """The projection of a log file (all its segments) or of an iterable of events."""
    if isinstance(source, str | os.PathLike):
        return project(read_events(source), where=str(source))
    return project(source)


__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_LINE",
    "decode_line",
    "decode_lines",
    "encode_line",
    "read_events",
    "read_events_file",
    "replay",
    "segments",
]
