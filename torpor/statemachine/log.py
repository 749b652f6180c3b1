"""The append-only event log: JSON Lines with a checksum per line.

Each line is one event, ``{"crc":"xxxxxxxx",...}``: the CRC-32 of the line with
the ``"crc"`` member removed (the line codec, :mod:`torpor.statemachine.codec`,
is re-exported here). Lines are flushed on every append and fsync'ed at
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

import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from torpor.errors import LogCorrupted
from torpor.statemachine.codec import DEFAULT_MAX_LINE, decode_line, decode_lines, encode_line
from torpor.statemachine.events import Event, EventKind
from torpor.statemachine.projection import Projection, project

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def segments(path: str | os.PathLike[str]) -> list[Path]:
    """The log's files in order: rotated segments (oldest first), then the active file."""
    rotated = _rotated(Path(path))
    files = [p for _, p in rotated]
    active = Path(path)
    if active.exists():
        files.append(active)
    return files


def _rotated(active: Path) -> list[tuple[int, Path]]:
    """The rotated segments ``NAME.<first seq>`` of the log at ``active``, oldest first, with their first seq."""
    rotated: list[tuple[int, Path]] = []
    if active.parent.is_dir():
        for candidate in active.parent.glob(active.name + ".*"):
            suffix = candidate.name[len(active.name) + 1 :]
            if suffix.isascii() and suffix.isdigit():
                rotated.append((int(suffix), candidate))
    rotated.sort()
    return rotated


def _read_file(file: Path) -> tuple[list[bytes], bytes]:
    """The complete lines of ``file`` (without newlines) and the text after its last newline."""
    with open(file, "rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    torn_tail = lines.pop()
    return lines, torn_tail


def _next_file(active: Path, expected: int | None, done: set[int]) -> tuple[int | None, Path] | None:
    """The next file to read: the rotated segment that holds ``expected`` (or the oldest unread), else the active one."""
    for index, (first, file) in enumerate(rotated := _rotated(active)):
        if first in done:
            continue
        following = rotated[index + 1][0] if index + 1 < len(rotated) else None
        if expected is not None and following is not None and following <= expected:
            continue  # all of it comes before what was read: pruned or read under another listing
        return first, file
    return (None, active) if active.exists() else None


def _events(path: str | os.PathLike[str], max_line: int, *, one_file: bool) -> Iterator[Event]:
    """Events of the log at ``path`` (all segments, sequence checked) or of the one file ``path``.

    A whole log is read file by file, each picked afresh from the directory
    (:func:`_next_file`), so a rotation or a pruning while it is read is seen as
    what it is: a file that vanished is looked for again under its new name, a
    file that opens past the next sequence number makes the reader look for the
    segment it missed, and a gap before a segment that opens with a ``snapshot``
    (a deleted or pruned segment: the snapshot carries the state) is a warning,
    not an error. Any other gap or repeat raises ``LogCorrupted``.
    """
    if one_file:
        lines, torn_tail = _read_file(Path(path))
        yield from decode_lines(lines, str(path), 0, max_line)
        if torn_tail:
            _warn_torn(path, len(lines) + 1, len(torn_tail))
        return
    active = Path(path)
    if not segments(active):
        msg = f"no event log at {path}"
        raise FileNotFoundError(msg)
    expected: int | None = None  # the next sequence number, once an event has been read
    done: set[int] = set()
    while (picked := _next_file(active, expected, done)) is not None:
        first, file = picked
        name = str(file)
        try:
            lines, torn_tail = _read_file(file)
        except FileNotFoundError:
            continue  # renamed by a rotation or pruned while we looked: list the directory again
        decoded = decode_lines(lines, name, 0, max_line)
        head = next(decoded, None)
        if head is not None and expected is not None and head.seq != expected:
            if head.seq > expected and _missed(active, expected, head.seq, done, first):
                continue  # a rotation renamed the file we needed after we listed: read it first
            if head.seq < expected or head.kind is not EventKind.SNAPSHOT:
                raise LogCorrupted(name, 1, f"sequence jumps from #{expected - 1} to #{head.seq}")
            logger.warning(
                "%s: events #%d..#%d are not on disk (a deleted or pruned segment); "
                "continuing from the snapshot at #%d",
                name,
                expected,
                head.seq - 1,
                head.seq,
            )
        if first is not None:
            done.add(first)
        lineno = 0
        if head is not None:
            lineno = 1
            expected = head.seq + 1
            yield head
            for event in decoded:
                lineno += 1
                if event.seq != expected:
                    raise LogCorrupted(name, lineno, f"sequence jumps from #{expected - 1} to #{event.seq}")
                expected = event.seq + 1
                yield event
        if torn_tail:
            if first is not None:
                raise LogCorrupted(name, len(lines) + 1, "unterminated line in a rotated segment")
            _warn_torn(file, len(lines) + 1, len(torn_tail))
        if first is None:
            if head is None and (picked := _next_file(active, expected, done)) is not None and picked[0] is not None:
                continue  # an empty new active file: a rotation renamed the one we listed; read that segment first
            return  # the active file is the last


def _warn_torn(file: str | os.PathLike[str], lineno: int, nbytes: int) -> None:
    logger.warning("%s:%d: ignoring a torn last line (%d bytes): the writer was interrupted", file, lineno, nbytes)


def _missed(active: Path, expected: int, found: int, done: set[int], current: int | None) -> bool:
    """True when an unread rotated segment (not ``current``) may hold events from ``expected`` up to ``found``."""
    picked = _next_file(active, expected, done | ({current} if current is not None else set()))
    return picked is not None and picked[0] is not None and picked[0] < found


def read_events(path: str | os.PathLike[str], max_line: int = DEFAULT_MAX_LINE) -> Iterator[Event]:
    """Every event in the log at ``path`` (all its segments), oldest first.

    Sequence numbers must increase by one; a gap or repeat raises ``LogCorrupted``
    (except at the start of a segment that opens with a snapshot).
    """
    return _events(path, max_line, one_file=False)


def read_events_file(file: Path, max_line: int = DEFAULT_MAX_LINE) -> Iterator[Event]:
    """Events of one file (one segment) only; a torn last line is tolerated with a warning."""
    return _events(file, max_line, one_file=True)


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
