"""The one reader of an event log's files: segments, rotation, torn lines, resume after a sequence number.

Every reader of a log goes through :class:`Tail`: ``read_events`` (the whole
history, once, strictly), :class:`~torpor.statemachine.log.follow.Follower` and
``follow()`` (``tail -f``), the telemetry :class:`~torpor.statemachine.log.logsource.LogSource`
(and so the standalone endpoint and the vLLM routes), ``torpor log`` and the
fleet view. A tail knows the files, not the line format: it frames bytes
into lines and hands them to the codec's ``decode_lines`` (given to it), so
lines are parsed and checked in one place.

What a tail guarantees, from ``after`` on: events come out in sequence order,
each once, and a call never blocks.

- **Segments and rotation.** The writer renames the active file ``NAME`` to
  ``NAME.<first seq>`` and starts a new one with a ``snapshot`` event. A tail
  holds the active file open, so a rotation while it reads is seen as the
  file it holds being replaced: it reads the rest of that file, then opens
  the new one. Events it has not seen that sit in rotated segments (it
  started late, or was away during several rotations) are read from the
  segments when the active file opens past them, when it is empty or gone.
- **Torn lines.** Only whole lines are read; an unfinished last line is read
  again on the next call (a writer that cuts such a line off and appends
  is followed cleanly, the cut being where the next read starts).
- **A replaced or truncated file.** A file that shrank below what was read
  is read again from its start (seen events skipped); a log deleted and
  started anew (event #1 again) is followed from its start.
- **Bad lines.** A line that is not a valid event raises
  :class:`~torpor.errors.LogCorrupted` naming the file and line, after the
  events before it; the next read starts at that line (and raises again,
  unless it was repaired in place).

``strict=True`` is how ``read_events`` reads a whole log once: any gap or
repeat in the sequence numbers raises ``LogCorrupted``, except a gap before a
segment that opens with a snapshot (a deleted or pruned segment: the
snapshot carries the state), which is a warning; a torn last line of the
active file is a warning, of a rotated segment an error. Without ``strict``
(following), a gap is a warning and a new log is followed from its start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Self

from torpor.errors import LogCorrupted, NoEventLog, TorporError
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.framing import batches, open_regular, read_lines, too_long, warn_torn
from torpor.statemachine.log.segments import rotated, segments

#: The codec's reader of complete lines: ``decode(lines, path, lineno before the first, max_line)``.
Decode = Callable[[Iterable[bytes], str, int, int], Iterator[Event]]

logger = logging.getLogger("torpor.statemachine.log")

_SNAPSHOT = EventKind.SNAPSHOT


def read_file(file: str | os.PathLike[str], decode: Decode, max_line: int) -> Iterator[Event]:
    """Events of one file (one segment) only, sequence unchecked; a torn last line is tolerated with a warning."""
    torn, lineno = [0], 0
    for lines in batches(Path(file), max_line, torn):
        yield from decode(lines, str(file), lineno, max_line)
        lineno += len(lines)
    if torn[0]:
        warn_torn(file, lineno + 1, torn[0])


class Tail:
    """Reads the log at ``path`` (all its segments) incrementally, from after sequence number ``after``.

    :meth:`events` yields what is on disk now and returns; call it again for
    what was appended since. :attr:`last_seq` is the last event handed out,
    so a consumer that stores it resumes with ``Tail(path, decode, after=last_seq)``.
    ``decode`` is the codec's ``decode_lines``; ``log`` the logger warnings go to.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        decode: Decode,
        after: int = 0,
        *,
        max_line: int,
        strict: bool = False,
        log: logging.Logger = logger,
    ) -> None:
        self.path = Path(path)
        self.last_seq = int(after)
        self.max_line = max_line
        self.strict = strict
        self._decode = decode
        self._log = log
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        self._pos = 0  # bytes of the held file read and handed out
        self._lineno = 0  # lines of the held file read
        self._torn = 0  # bytes after the last newline at the last read
        self._first_in_file = False
        self._opened_before = False
        self._checked_after = after <= 0
        self._skipped = 0  # the last already-seen sequence number met (resuming after ``after``)

    # -- public -----------------------------------------------------------------

    def events(self) -> Iterator[Event]:
        """Every whole event on disk after :attr:`last_seq`, in order; a bad line raises after the events before it."""
        if self.strict and not segments(self.path):
            msg = f"no event log at {self.path}"
            raise NoEventLog(msg)
        try:
            while True:
                if self._fd is None and not self._open():
                    yield from self._from_segments(None)  # not created yet, or mid-rotation
                    if not self._open():
                        return
                yield from self._read_held()
                if self._first_in_file:  # no event in it yet: a crash right after a rotation renamed the last one
                    yield from self._from_segments(None)
                if not self._replaced():
                    if self.strict and self._torn:
                        warn_torn(self.path, self._lineno + 1, self._torn)
                    return
                yield from self._read_held()  # what the writer wrote before it renamed the file
                if self._torn and self.strict:
                    raise LogCorrupted(str(self.path), self._lineno + 1, "unterminated line in a rotated segment")
                self._close()
        finally:
            if self.strict:
                self._close()

    def _read_held(self) -> Iterator[Event]:
        """The held file's new whole lines as events, a window at a time; its position moves past each window read.

        Sets :attr:`_torn`; a line longer than ``max_line`` raises after the events before it.
        """
        fd = self._fd
        if fd is None:
            return
        self._check_shrunk(fd)
        seen, read = self.last_seq, False
        while True:
            lines, used, rest = read_lines(fd, self._pos, self.max_line)
            if lines:
                read = True
                yield from self._lines(lines, str(self.path), self._lineno, search=True)
                self._pos += used
                self._lineno += len(lines)
            if rest < 0 and lines:  # a full window: the file goes on
                continue
            if rest < 0 or rest > self.max_line:
                raise too_long(str(self.path), self._lineno + 1, self.max_line)
            self._torn = rest
            break
        if read and not self._checked_after:
            self._checked_after = True
            if self.last_seq == seen and self._skipped < seen:
                self._log.warning(
                    "%s ends at event #%d, before after=#%d: is it a new log? waiting for #%d",
                    self.path,
                    self._skipped,
                    seen,
                    seen + 1,
                )

    def read_available(self) -> list[Event]:
        """Every whole event on disk after :attr:`last_seq`, as a list; never blocks.

        A bad line raises, unless events came before it in this call: then
        those are returned first, and the next call starts at the bad line.
        """
        out: list[Event] = []
        append = out.append
        try:
            for event in self.events():
                append(event)
        except TorporError:
            if out:
                return out
            raise
        return out

    def close(self) -> None:
        """Close the file being read (a later read opens it again)."""
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the held (active) file ---------------------------------------------------------

    def _open(self) -> bool:
        try:
            fd = open_regular(self.path)
        except FileNotFoundError:
            return False
        st = os.fstat(fd)
        self._fd, self._ident = fd, (st.st_dev, st.st_ino)
        self._pos, self._lineno, self._torn = 0, 0, 0
        self._first_in_file = True
        return True

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._opened_before = True
        self._fd, self._ident = None, None

    def _replaced(self) -> bool:
        """True when the path no longer names the file held (rotated, or deleted)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._ident

    def _check_shrunk(self, fd: int) -> None:
        """Read the held file again from its start when it was cut below what was read (and perhaps written past it)."""
        size = os.fstat(fd).st_size
        if size < self._pos or (self._pos and os.pread(fd, 1, self._pos - 1) != b"\n"):
            self._log.warning("%s shrank below what was read (%d bytes); reading it again", self.path, self._pos)
            self._pos, self._lineno, self._first_in_file = 0, 0, True

    def _lines(self, lines: list[bytes], name: str, lineno: int, *, search: bool) -> Iterator[Event]:
        """The events of ``lines`` (the first is line ``lineno + 1`` of ``name``) after :attr:`last_seq`.

        ``search``: the lines are the held file's, so a gap before them is
        looked for in the rotated segments; otherwise they are a rotated
        segment's, whose events up to :attr:`last_seq` were seen. On a bad
        line of the held file its position is left at that line.
        """
        expected = self.last_seq + 1
        floor = 0 if search else self.last_seq  # a segment's events up to here were handed out already
        first = self._first_in_file if search else False
        number = lineno  # the last line handled outside the common case (counted when the next one is)
        run = expected  # ``expected`` when the current run of common-case lines began
        try:
            for event in self._decode(lines, name, lineno, self.max_line):
                if event.seq == expected and not first:  # the common case: the next event
                    self.last_seq = expected
                    expected += 1
                    yield event
                    continue
                number += expected - run + 1  # the run's lines, then this one
                first = False
                yield from self._other(event, name, number, search=search, floor=floor)
                expected = run = self.last_seq + 1
        except TorporError as exc:
            line = getattr(exc, "line", None)
            if search and getattr(exc, "path", None) == name and isinstance(line, int) and line > lineno:
                done = line - lineno - 1  # whole lines before the bad one
                self._pos += sum(len(text) for text in lines[:done]) + done
                self._lineno = line - 1
                if done:
                    self._first_in_file = False
            raise

    def _other(self, event: Event, name: str, number: int, *, search: bool, floor: int) -> Iterator[Event]:
        """An event that is not simply the next one: the first of a file, a repeat, a gap."""
        if search and self._first_in_file:
            self._first_in_file = False
            if (
                event.seq == 1
                and event.kind is not _SNAPSHOT
                and self._opened_before
                and self.last_seq >= 1
                and not self.strict
            ):
                self._log.warning(
                    "%s was started anew (event #1 after #%d); following the new log", self.path, self.last_seq
                )
                self.last_seq = 0
        seq, last = event.seq, self.last_seq
        if seq <= last:
            if self.strict and seq > floor:
                raise LogCorrupted(name, number, f"sequence jumps from #{last} to #{seq}")
            self._skipped = seq
            return
        if seq > last + 1 and search:
            yield from self._from_segments(seq)
            last = self.last_seq
        if seq > last + 1:
            if not self.strict:
                self._log.warning(
                    "%s: events #%d..#%d are no longer on disk (pruned segments); continuing at #%d",
                    self.path,
                    last + 1,
                    seq - 1,
                    seq,
                )
            elif number == 1 and not last:
                pass  # the first event read: the log starts here (its older segments were pruned)
            elif number == 1 and event.kind is _SNAPSHOT:
                self._log.warning(
                    "%s: events #%d..#%d are not on disk (a deleted or pruned segment); "
                    "continuing from the snapshot at #%d",
                    name,
                    last + 1,
                    seq - 1,
                    seq,
                )
            else:
                raise LogCorrupted(name, number, f"sequence jumps from #{last} to #{seq}")
        self.last_seq = seq
        yield event

    # -- rotated segments ------------------------------------------------------------

    def _from_segments(self, upto: int | None) -> Iterator[Event]:
        """Events after :attr:`last_seq` (and before ``upto``) from the rotated segments."""
        found = rotated(self.path)
        for index, (first, segment) in enumerate(found):
            following = found[index + 1][0] if index + 1 < len(found) else None
            if following is not None and following <= self.last_seq + 1:
                continue  # everything in it was seen
            if upto is not None and first >= upto:
                return
            name, torn, lineno = str(segment), [0], 0
            try:
                for lines in batches(segment, self.max_line, torn):
                    if upto is not None:
                        handed = self.last_seq
                        for event in self._lines(lines, name, lineno, search=False):
                            if event.seq >= upto:  # the held file has it
                                self.last_seq = handed
                                return
                            handed = event.seq
                            yield event
                    else:
                        yield from self._lines(lines, name, lineno, search=False)
                    lineno += len(lines)
            except FileNotFoundError:
                continue  # pruned while we looked
            if torn[0]:
                if self.strict:
                    raise LogCorrupted(name, lineno + 1, "unterminated line in a rotated segment")
                warn_torn(segment, lineno + 1, torn[0])


def read_log(path: str | os.PathLike[str], decode: Decode, max_line: int) -> Iterator[Event]:
    """Every event of the log at ``path`` (all its segments), oldest first, read once and strictly.

    Sequence numbers must increase by one; a gap or repeat raises ``LogCorrupted``
    (except at the start of a segment that opens with a snapshot).
    """
    return Tail(path, decode, max_line=max_line, strict=True).events()


__all__ = ["Decode", "Tail", "read_file", "read_log"]
