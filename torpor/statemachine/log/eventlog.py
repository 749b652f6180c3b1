"""The event log's writer: :class:`EventLog`, append-only, one writer per log, whole lines only.

Reading lives in :mod:`torpor.statemachine.log.reader` (which re-exports this class);
opening files safely on a shared host in :mod:`torpor.statemachine.log.files`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import weakref
from pathlib import Path

from torpor.errors import (
    BadArgument,
    EventTooLarge,
    LogClosed,
    LogCorrupted,
    LogWriteFailed,
    NotAnEventLog,
    NothingWritten,
)
from torpor.statemachine.core.events import BOUNDARY_KINDS, Event
from torpor.statemachine.log import files as logfile
from torpor.statemachine.log.codec import LINE_PREFIX, unreadable
from torpor.statemachine.log.interrupts import UNINTERRUPTED
from torpor.statemachine.log.reader import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_LINE,
    decode_line,
    encode_line,
    read_current,
    segments,
)
from torpor.statemachine.log.segments import rotated, segment_path

logger = logging.getLogger("torpor.statemachine.log")


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
        if size <= max_line and head.startswith(LINE_PREFIX):
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


#: The smallest ``max_bytes``: below it nearly every event would start a new file (``0`` rotated after each).
MIN_MAX_BYTES = 256
#: The smallest ``max_line``: a line shorter cannot hold an event.
MIN_MAX_LINE = 128
_MAX_INT = 2**63 - 1


def _check_limits(max_bytes: object, max_line: object, keep: object) -> None:
    """Refuse a rotation size, line limit or segment count that would rotate after every event or prune everything."""
    if type(max_bytes) is not int or not MIN_MAX_BYTES <= max_bytes <= _MAX_INT:
        msg = (
            f"max_bytes={max_bytes!r} is refused: the active file is rotated once it passes max_bytes, an int of "
            f"at least {MIN_MAX_BYTES} (default {DEFAULT_MAX_BYTES}); a smaller one rotates after nearly every event"
        )
        raise BadArgument(msg)
    if type(max_line) is not int or not MIN_MAX_LINE <= max_line <= _MAX_INT:
        msg = f"max_line={max_line!r} is refused: the longest line, an int of at least {MIN_MAX_LINE} (default {DEFAULT_MAX_LINE})"
        raise BadArgument(msg)
    if keep is not None and (type(keep) is not int or keep < 0):
        msg = (
            f"keep={keep!r} is refused: how many rotated segments stay on disk, an int >= 0 (0 keeps none, "
            "only the active file), or None to keep all"
        )
        raise BadArgument(msg)


#: Every writer open in this process: a forked child lets go of their files (:func:`_forget_in_child`).
_OPEN: weakref.WeakSet[EventLog] = weakref.WeakSet()


def _forget_in_child() -> None:
    """In a forked child: close the inherited log descriptors; the child is not the writer and must not write."""
    for log in list(_OPEN):
        log._forget()


os.register_at_fork(after_in_child=_forget_in_child)


class EventLog:
    """Append-only, checksummed JSON Lines event log for one engine rank, with one writer.

    ``fsync`` makes boundary events (those that begin or end a transition)
    durable; ``max_bytes`` (at least 256) rotates the active file; ``keep``
    bounds how many rotated segments stay on disk (None keeps all; a negative
    count, or a ``max_bytes`` that would rotate after nearly every event, is a
    ``ValueError`` before anything is made). Opening takes the log's
    writer lock (``.NAME.lock``) for the life of this object: a second writer is
    refused with :class:`~torpor.errors.LogLocked`. The file is opened as
    :mod:`torpor.statemachine.log.files` describes (no links followed, nobody
    else's file, never a file that is not a torpor log). A write that fails
    (a full disk) cuts the file back to its last whole line and raises
    :class:`~torpor.errors.LogWriteFailed`; the event is then not recorded.
    Any other exception on the way (a signal handler's, at any step of
    :meth:`append`) does the same and is raised as it was: the file and
    :attr:`last_seq` always agree, so the log reads and the next append
    follows on (signal handlers are held back around the step besides:
    :mod:`torpor.statemachine.log.interrupts`).
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
        _check_limits(max_bytes, max_line, keep)  # before the directory or a file is made
        self.path = Path(path)
        self.fsync = fsync
        self.max_bytes = max_bytes
        self.max_line = max_line
        self.keep = keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._torn = False  # a failed write could not be cut back: cut before the next write
        self._forked = False  # this object was inherited by a forked child: it writes nothing
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
            older = rotated(self.path)
            if not self.last_seq and older:
                # No event in the active file: a crash right after a rotation renamed it. The newest
                # segment's last event is the last one (read from its snapshot on, not the whole history).
                *_, last = read_current(self.path, self.max_line)
                self.last_seq = last.seq
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._size = valid
        _OPEN.add(self)

    def _forget(self) -> None:
        """In a forked child: close the inherited descriptor (the parent's stays open) and refuse every write."""
        self._forked = True
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

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
        problem = unreadable(event, line)
        if problem is not None:  # what the writer accepts, every reader reads
            reason = f"it would not read back ({problem}); nothing was written"
            raise LogWriteFailed(str(self.path), event.kind.value, event.seq, reason)
        with UNINTERRUPTED, self._lock:  # the line and its count are one step: a Ctrl-C comes before or after
            if event.seq != self.last_seq + 1:
                msg = f"event #{event.seq} appended after #{self.last_seq}: sequence numbers must follow on"
                raise BadArgument(msg)
            size = self._size + len(line)  # worked out before the write: after it, nothing but two stores
            self._write(line, event, sync=self.fsync and event.kind in BOUNDARY_KINDS)
            self.last_seq, self._size = event.seq, size

    def _write(self, line: bytes, event: Event, *, sync: bool) -> None:
        """Write the whole line (a short write is continued) or none of it; the caller holds the lock."""
        fd = self._fd
        if fd is None and self._forked:  # a LogWriteFailed, so the controller's paths for an unwritable log apply
            reason = f"this process (pid {os.getpid()}) is a forked child of the log's writer, which alone writes it"
            raise LogWriteFailed(str(self.path), event.kind.value, event.seq, reason)
        if fd is None:
            msg = f"the event log {self.path} is closed"
            raise LogClosed(msg)
        if self._torn:
            self._cut_back(event)
        written = 0
        try:
            while written < len(line):
                n = os.write(fd, line[written:])
                if n <= 0:
                    raise NothingWritten(errno.ENOSPC, "no byte written")
                written += n
            if sync:
                os.fsync(fd)
        except BaseException as exc:  # a full disk, or whatever a signal handler raised: the event is not recorded
            # Cut back whatever reached the file, even when nothing was counted (an exception right after
            # ``os.write`` returned, before its count was stored): a line the count lacks repeats a number.
            self._torn = True
            self._cut_back(event)
            if isinstance(exc, OSError):
                raise LogWriteFailed(str(self.path), event.kind.value, event.seq, str(exc)) from exc
            raise

    def _cut_back(self, event: Event) -> None:
        """Cut the file back to its last whole line (after a failed write); a file already there is left alone."""
        try:
            if os.fstat(self._fd).st_size != self._size:  # type: ignore[arg-type]
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
        with UNINTERRUPTED, self._lock:  # never between the two renames, nor before the new file is held
            if snapshot.seq != self.last_seq + 1:
                msg = f"snapshot #{snapshot.seq} after #{self.last_seq}: sequence numbers must follow on"
                raise BadArgument(msg)
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
                    raise NothingWritten(errno.ENOSPC, "no byte written")
                written += n
            if self.fsync:
                os.fsync(fd)
            first = self._first_seq()
            os.replace(self.path, segment_path(self.path, first))
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

    def _first_seq(self) -> int:
        """The sequence number of the active file's first event: its first line only, not the whole file."""
        with open(self.path, "rb") as fh:
            line = fh.readline(self.max_line + 1)
        return decode_line(line, str(self.path), 1, self.max_line).seq

    def close(self) -> None:
        """Close the file and release the writer lock (events already appended stay); safe to call twice."""
        with UNINTERRUPTED, self._lock:
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
