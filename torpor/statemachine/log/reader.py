"""The append-only event log: JSON Lines with a checksum per line.

Each line is one event, ``{"crc":"xxxxxxxx",...}``: the CRC-32 of the line with
the ``"crc"`` member removed (the line codec, :mod:`torpor.statemachine.log.codec`,
is re-exported here). Lines are flushed on every append and fsync'ed at
transition boundaries (configurable). The writer, :class:`EventLog`
(:mod:`torpor.statemachine.log.eventlog`, re-exported here), opens its files as
:mod:`torpor.statemachine.log.files` describes (0600, no links followed, one
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

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.codec import DEFAULT_MAX_LINE, decode_line, decode_lines, encode_line
from torpor.statemachine.log.framing import open_regular
from torpor.statemachine.log.segments import rotated, segments
from torpor.statemachine.log.tail import Tail, read_file, read_log
from torpor.statemachine.projection.view import Projection, project

DEFAULT_MAX_BYTES = 64 * 1024 * 1024


def read_events(path: str | os.PathLike[str], max_line: int = DEFAULT_MAX_LINE) -> Iterator[Event]:
    """Every event in the log at ``path`` (all its segments), oldest first (:func:`torpor.statemachine.log.tail.read_log`).

    Sequence numbers must increase by one; a gap or repeat raises ``LogCorrupted``
    (except at the start of a segment that opens with a snapshot).
    """
    return read_log(path, decode_lines, max_line)


def latest_snapshot(path: str | os.PathLike[str], max_line: int = DEFAULT_MAX_LINE) -> int:
    """The sequence number of the snapshot that opens the log's newest file (0: none, read from the start).

    Each rotation starts the new active file with a ``snapshot`` of the whole
    projection, so a reader that only needs the state now reads from there;
    only the first line of the active file (or, when it holds no event yet, of
    the newest segment) is read. A first line that is no snapshot means no
    rotation: the log is read from its start.
    """
    active = Path(path)
    for file in (active, *(segment for _, segment in reversed(rotated(active)))):
        try:
            fd = open_regular(file)
        except FileNotFoundError:
            continue
        try:
            first = os.pread(fd, max_line + 1, 0)
        finally:
            os.close(fd)
        end = first.find(b"\n")
        if end < 0:  # empty, or its first line not finished: the events are in the file before it
            continue
        event = decode_line(first[:end], str(file), 1, max_line)
        return event.seq if event.kind is EventKind.SNAPSHOT else 0
    return 0


def read_current(path: str | os.PathLike[str], max_line: int = DEFAULT_MAX_LINE) -> Iterator[Event]:
    """The events a projection of the log's state now needs: from :func:`latest_snapshot` on, read strictly.

    What a restarted controller reads: the cost is the newest file's, however
    long the history (``read_events``/``replay`` read it all). The projection
    is the same: the snapshot carries it whole.
    """
    after = latest_snapshot(path, max_line)
    return Tail(path, decode_lines, after=max(after - 1, 0), max_line=max_line, strict=True).events()


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
    "latest_snapshot",
    "read_current",
    "read_events",
    "read_events_file",
    "replay",
    "segments",
]
