"""The append-only event log: JSON Lines with a checksum per line.

Each line is one event, ``{"crc":"xxxxxxxx",...}``: the CRC-32 of the line with
the ``"crc"`` member removed. Lines are flushed on every append and fsync'ed at
transition boundaries (configurable). The writer opens its files as
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

import contextlib
import errno
import json
import logging
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from torpor.errors import EventTooLarge, LogCorrupted, LogWriteFailed, NotAnEventLog, UnknownSchemaVersion
from torpor.statemachine import logfile
from torpor.statemachine.events import BOUNDARY_KINDS, SCHEMA_VERSION, Event, EventKind, plain_event
from torpor.statemachine.payload import payload_problem

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
            logger.warning(
                "%s:%d: ignoring a torn last line (%d bytes): the writer was interrupted",
                path,
                len(lines) + 1,
                len(torn_tail),
            )
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
            logger.warning(
                "%s:%d: ignoring a torn last line (%d bytes): the writer was interrupted",
                file,
                len(lines) + 1,
                len(torn_tail),
            )
        if first is None:
            if head is None and (picked := _next_file(active, expected, done)) is not None and picked[0] is not None:
                continue  # an empty new active file: a rotation renamed the one we listed; read that segment first
            return  # the active file is the last


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


def _line_number(fd: int, offset: int) -> int:
    """The number of the line that starts at byte ``offset`` (1-based), counting newlines before it."""
    count, pos = 0, 0
    while pos < offset:
        chunk = os.pread(fd, min(1 << 20, offset - pos), pos)
        if not chunk:
            break
        count += chunk.count(b"\n")
        pos += len(chunk)
    return count + 1


def _inspect(fd: int, name: str, max_line: int) -> tuple[int, int]:
    """(last sequence number, length of the valid prefix) of an open log file; refuse one that is not a log.

    The first line must be an event (or, in a file without a newline yet, the
    start of one: a first write torn by a crash); otherwise the file is not a
    torpor log and :class:`NotAnEventLog` is raised before anything is cut or
    written. Only the first and the last lines are read.
    """
    size = os.fstat(fd).st_size
    if not size:
        return 0, 0
    head = os.pread(fd, min(size, max_line + 1), 0)
    newline = head.find(b"\n")
    if newline < 0:
        if size <= max_line and head.startswith(_PREFIX_B):
            logger.warning("%s: cutting a torn first line (%d bytes) before appending", name, size)
            return 0, 0
        raise NotAnEventLog(name, "it has no line that is a checksummed event")
    try:
        decode_line(head[: newline + 1], name, 1, max_line)
    except LogCorrupted as exc:
        raise NotAnEventLog(name, f"line 1: {exc.reason}") from None
    window = min(size, 2 * max_line + 2)
    tail = os.pread(fd, window, size - window)
    last_nl = tail.rfind(b"\n")
    if last_nl < 0:
        raise LogCorrupted(name, _line_number(fd, size - window), "a line longer than the line limit at the end")
    end = size - window + last_nl + 1
    if end < size:
        logger.warning("%s: cutting a torn last line (%d bytes) before appending", name, size - end)
    start_in_tail = tail.rfind(b"\n", 0, last_nl) + 1
    if start_in_tail == 0 and size - window > 0:
        raise LogCorrupted(name, _line_number(fd, size - window), "a line longer than the line limit")
    start = size - window + start_in_tail
    line = tail[start_in_tail:last_nl]
    try:
        last = decode_line(line, name, 0, max_line).seq
    except LogCorrupted as exc:
        raise LogCorrupted(name, _line_number(fd, start), exc.reason) from None
    return last, end


class EventLog:
    """Append-only, checksummed JSON Lines event log for one engine rank, with one writer.

    ``fsync`` makes boundary events (those that begin or end a transition)
    durable; ``max_bytes`` rotates the active file; ``keep`` bounds how many
    rotated segments stay on disk (None keeps all). Opening takes the log's
    writer lock (``.NAME.lock``) for the life of this object: a second writer is
    refused with :class:`~torpor.errors.LogLocked`. The file is opened as
    :mod:`torpor.statemachine.logfile` describes (no links followed, nobody
    else's file, never a file that is not a torpor log). A write that fails
    (a full disk) cuts the file back to its last whole line and raises
    :class:`~torpor.errors.LogWriteFailed`; the event is then not recorded.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = True,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_line: int = DEFAULT_MAX_LINE,
        keep: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.max_bytes = max_bytes
        self.max_line = max_line
        self.keep = keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._torn = False  # a failed write could not be cut back: cut before the next write
        self._next_rotation = max_bytes
        logfile.prepare_directory(self.path.parent)
        self._writer = logfile.WriterLock(self.path)
        try:
            self._open()
        except BaseException:
            self._writer.release()
            raise

    def _open(self) -> None:
        fd, _created = logfile.open_file(self.path, readable=True)
        try:
            self.last_seq, valid = _inspect(fd, str(self.path), self.max_line)
            if valid < os.fstat(fd).st_size:
                os.ftruncate(fd, valid)
            if not self.last_seq and segments(self.path)[:-1]:
                # No event in the active file: a crash right after a rotation renamed it.
                *_, last = read_events(self.path, self.max_line)
                self.last_seq = last.seq
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._size = valid

    def next_seq(self) -> int:
        """The sequence number the next appended event must carry."""
        return self.last_seq + 1

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._fd is None

    def append(self, event: Event) -> None:
        """Write ``event``; fsync it when it is a boundary and ``fsync`` is on."""
        line = encode_line(event)
        if len(line) > self.max_line:
            raise EventTooLarge(event.kind.value, len(line), self.max_line)
        with self._lock:
            if event.seq != self.last_seq + 1:
                msg = f"event #{event.seq} appended after #{self.last_seq}: sequence numbers must follow on"
                raise ValueError(msg)
            self._write(line, event, sync=self.fsync and event.kind in BOUNDARY_KINDS)
            self.last_seq = event.seq
            self._size += len(line)

    def _write(self, line: bytes, event: Event, *, sync: bool) -> None:
        """Write the whole line (a short write is continued) or none of it; the caller holds the lock."""
        fd = self._fd
        if fd is None:
            msg = f"the event log {self.path} is closed"
            raise ValueError(msg)
        if self._torn:
            self._cut_back(event)
        written = 0
        try:
            while written < len(line):
                n = os.write(fd, line[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, "no byte written")
                written += n
            if sync:
                os.fsync(fd)
        except BaseException as exc:
            if written:
                self._torn = True
                self._cut_back(event)
            if isinstance(exc, OSError):
                raise LogWriteFailed(str(self.path), event.kind.value, event.seq, str(exc)) from exc
            raise

    def _cut_back(self, event: Event) -> None:
        """Cut the file back to its last whole line (after a failed write)."""
        try:
            os.ftruncate(self._fd, self._size)  # type: ignore[arg-type]
        except OSError as exc:
            reason = f"a failed write could not be cut back ({exc}); nothing more is written until it can"
            raise LogWriteFailed(str(self.path), event.kind.value, event.seq, reason) from exc
        self._torn = False

    def needs_rotation(self) -> bool:
        """True once the active file has passed ``max_bytes`` (and the last rotation did not fail since)."""
        return self._size >= self.max_bytes and self._size >= self._next_rotation

    def rotate(self, snapshot: Event) -> None:
        """Close the active file as a segment; start a new one with ``snapshot``.

        The new file is written first (``.NAME.next``, the snapshot fsync'ed)
        and then renamed into place, so a failure (a full disk) leaves the log
        as it was and raises; the caller keeps appending to the active file,
        and the next rotation is tried after another ``max_bytes``.
        """
        line = encode_line(snapshot)
        if len(line) > self.max_line:
            self._next_rotation = self._size + self.max_bytes
            raise EventTooLarge(snapshot.kind.value, len(line), self.max_line)
        with self._lock:
            if snapshot.seq != self.last_seq + 1:
                msg = f"snapshot #{snapshot.seq} after #{self.last_seq}: sequence numbers must follow on"
                raise ValueError(msg)
            try:
                self._rotate(line, snapshot)
            except BaseException:
                self._next_rotation = self._size + self.max_bytes
                raise
            self.last_seq = snapshot.seq
            self._size = len(line)
            self._next_rotation = self.max_bytes
        if self.keep is not None:
            old = segments(self.path)[:-1]
            for stale in old[: max(0, len(old) - self.keep)]:
                try:
                    stale.unlink()
                except OSError as exc:  # the rotation is done; an old segment stays
                    logger.warning("could not prune %s: %s", stale, exc)

    def _rotate(self, line: bytes, snapshot: Event) -> None:
        nxt = self.path.with_name(f".{self.path.name}.next")  # hidden: globs of NAME.* see segments only
        with contextlib.suppress(FileNotFoundError):  # left by a crash mid-rotation (we hold the writer lock)
            os.unlink(nxt)
        fd, _ = logfile.open_file(nxt, readable=True)
        try:
            written = 0
            while written < len(line):
                n = os.write(fd, line[written:])
                if n <= 0:
                    raise OSError(errno.ENOSPC, "no byte written")
                written += n
            if self.fsync:
                os.fsync(fd)
            first = next(read_events_file(self.path, self.max_line)).seq
            os.replace(self.path, self.path.with_name(f"{self.path.name}.{first:012d}"))
        except BaseException as exc:
            os.close(fd)
            try:
                os.unlink(nxt)
            except OSError:
                logger.warning("could not remove %s after a failed rotation", nxt)
            if isinstance(exc, OSError):
                raise LogWriteFailed(str(self.path), snapshot.kind.value, snapshot.seq, str(exc)) from exc
            raise
        os.replace(nxt, self.path)  # only a crash can stop here: the log then has segments only, which is read fine
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)
        if self.fsync:
            dfd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def close(self) -> None:
        """Close the file and release the writer lock (events already appended stay); safe to call twice."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
            self._writer.release()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)
        writer = getattr(self, "_writer", None)
        if writer is not None:
            writer.release()


def read_events_file(file: Path, max_line: int = DEFAULT_MAX_LINE) -> Iterator[Event]:
    """Events of one file (one segment) only; a torn last line is tolerated with a warning."""
    return _events(file, max_line, one_file=True)
