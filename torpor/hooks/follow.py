"""Out-of-process RL hooks: follow a rank's event log as it grows (tail -f that survives rotation).

An RL controller in another process (verl, OpenRLHF and the like) reads the
transitions from the per-rank log the engine's ``SleepController`` writes. Each
line is decoded and checksum-verified with the log's own ``decode_lines``;
nothing read is executed. Events come out in sequence order, exactly once, from
``after`` on: the follower reads rotated segments it has not seen (a rotation
renames the active file to ``NAME.<first seq>`` and starts a new file with a
``snapshot`` event), waits for a torn last line to be completed, and copes with
the writer cutting such a line off when it reopens the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

from torpor.errors import TorporError
from torpor.statemachine.events import Event, EventKind
from torpor.statemachine.log import DEFAULT_MAX_LINE, decode_lines, read_events_file, segments

logger = logging.getLogger("torpor.hooks")

_CHUNK = 1 << 20


class _Flag(Protocol):
    def is_set(self) -> bool: ...


#: What ends a follow: a ``threading.Event``/``asyncio.Event`` (anything with ``is_set``) or a callable.
Stop = _Flag | Callable[[], bool] | None


def _stopped(stop: Stop) -> bool:
    if stop is None:
        return False
    is_set = getattr(stop, "is_set", None)
    if callable(is_set):
        return bool(is_set())
    return bool(stop())  # type: ignore[operator]


class Follower:
    """Reads a rank's event log incrementally; :meth:`read_available` never blocks.

    ``after`` is the last sequence number already seen (0: from the start);
    :attr:`last_seq` advances as events are returned, so a consumer that
    stores it can resume later with ``Follower(path, after=last_seq)``.
    """

    def __init__(self, path: str | os.PathLike[str], after: int = 0, *, max_line: int = DEFAULT_MAX_LINE) -> None:
        self.path = Path(path)
        self.last_seq = int(after)
        self.max_line = max_line
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None
        self._pos = 0
        self._lineno = 0
        self._first_in_file = False
        self._opened_before = False
        self._checked_after = after <= 0

    # -- public -----------------------------------------------------------------

    def read_available(self) -> list[Event]:
        """Every complete event appended since the last call (after :attr:`last_seq`), in order."""
        out: list[Event] = []
        while True:
            if self._fd is None and not self._open(out):
                return out
            if not self._read(out) or not self._replaced():
                return out
            if not self._read(out):  # what the writer wrote before it renamed the file
                return out
            self._close()

    def close(self) -> None:
        """Close the file being followed."""
        self._close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------

    def _open(self, out: list[Event]) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            # Not created yet, or between a rotation's rename and its new file.
            self._from_segments(out, upto=None)
            return False
        st = os.fstat(fd)
        self._fd, self._ident = fd, (st.st_dev, st.st_ino)
        self._pos, self._lineno = 0, 0
        self._first_in_file = True
        return True

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._ident = None, None
        self._opened_before = True

    def _replaced(self) -> bool:
        """True when the path no longer names the file we hold (rotated, or deleted)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._ident

    def _read(self, out: list[Event]) -> bool:
        """Decode the complete lines after :attr:`_pos`; False when it stopped at a bad line.

        An incomplete last line is read again next time: never consuming a
        partial line is what makes a writer that cuts a torn line off and
        appends again safe to follow (the cut is always at the start of the
        partial line, where the next read begins). A bad line raises, unless
        events came before it in this call: then those are returned first and
        the next call starts at the bad line and raises.
        """
        fd = self._fd
        if fd is None:
            return True
        if os.fstat(fd).st_size < self._pos:
            logger.warning("%s shrank below what was read (%d bytes); reading it again", self.path, self._pos)
            self._pos, self._lineno, self._first_in_file = 0, 0, True
        os.lseek(fd, self._pos, os.SEEK_SET)
        chunks = []
        while data := os.read(fd, _CHUNK):
            chunks.append(data)
        data = b"".join(chunks)
        end = data.rfind(b"\n") + 1
        if not end:
            return True
        last: Event | None = None
        lines = data[: end - 1].split(b"\n")
        decoded = decode_lines(lines, str(self.path), self._lineno, self.max_line)
        for line in lines:
            try:
                event = next(decoded)
            except TorporError:
                if out:
                    return False
                raise
            self._accept(event, out)
            self._pos += len(line) + 1
            self._lineno += 1
            last = event
        if not self._checked_after and last is not None:
            self._checked_after = True
            if last.seq < self.last_seq:
                logger.warning(
                    "%s ends at event #%d, before after=#%d: is it a new log? waiting for #%d",
                    self.path,
                    last.seq,
                    self.last_seq,
                    self.last_seq + 1,
                )
        return True

    def _accept(self, event: Event, out: list[Event]) -> None:
        if self._first_in_file:
            self._first_in_file = False
            fresh = event.seq == 1 and event.kind is not EventKind.SNAPSHOT
            if fresh and self._opened_before and self.last_seq >= 1:
                logger.warning(
                    "%s was started anew (event #1 after #%d); following the new log", self.path, self.last_seq
                )
                self.last_seq = 0
        if event.seq <= self.last_seq:
            return
        if event.seq > self.last_seq + 1:
            self._from_segments(out, upto=event.seq)
        self._take(event, out)

    def _take(self, event: Event, out: list[Event]) -> None:
        if event.seq > self.last_seq + 1:
            logger.warning(
                "%s: events #%d..#%d are no longer on disk (pruned segments); continuing at #%d",
                self.path,
                self.last_seq + 1,
                event.seq - 1,
                event.seq,
            )
        out.append(event)
        self.last_seq = event.seq

    def _from_segments(self, out: list[Event], upto: int | None) -> None:
        """Events after :attr:`last_seq` (and before ``upto``) from rotated segments."""
        rotated = [p for p in segments(self.path) if p != self.path]
        firsts = [int(p.name.rsplit(".", 1)[1]) for p in rotated]
        for index, segment in enumerate(rotated):
            following = firsts[index + 1] if index + 1 < len(firsts) else None
            if following is not None and following <= self.last_seq + 1:
                continue  # everything in it was seen
            if upto is not None and firsts[index] >= upto:
                break
            try:
                events = list(read_events_file(segment, self.max_line))
            except FileNotFoundError:
                continue  # pruned while we looked
            for event in events:
                if event.seq <= self.last_seq:
                    continue
                if upto is not None and event.seq >= upto:
                    return
                self._take(event, out)


def _wanted(kinds: Iterable[EventKind | str] | None) -> frozenset[EventKind] | None:
    return None if kinds is None else frozenset(EventKind(k) for k in kinds)


def follow(
    path: str | os.PathLike[str],
    after: int = 0,
    *,
    kinds: Iterable[EventKind | str] | None = None,
    poll: float = 0.1,
    stop: Stop = None,
    idle_timeout: float | None = None,
    max_line: int = DEFAULT_MAX_LINE,
) -> Iterator[Event]:
    """Yield the events of the log at ``path`` after sequence number ``after``, waiting for new ones.

    Like ``tail -f``: it waits for the file to appear, survives rotation, and
    checks for new lines every ``poll`` seconds. It ends once ``stop`` is set
    (an ``Event`` or a callable returning True), after yielding what was on
    disk at that moment, or after ``idle_timeout`` seconds without a new
    event; otherwise it runs until the consumer stops iterating. ``kinds``
    keeps only events of those kinds.
    """
    wanted = _wanted(kinds)
    follower = Follower(path, after, max_line=max_line)
    wait = getattr(stop, "wait", None)
    quiet_since = time.monotonic()
    try:
        while True:
            stopping = _stopped(stop)
            events = follower.read_available()
            yield from (e for e in events if wanted is None or e.kind in wanted)
            if stopping:
                return
            now = time.monotonic()
            if events:
                quiet_since = now
            elif idle_timeout is not None and now - quiet_since >= idle_timeout:
                return
            if not events:
                if isinstance(stop, threading.Event) and callable(wait):
                    wait(poll)
                else:
                    time.sleep(poll)
    finally:
        follower.close()


async def follow_async(
    path: str | os.PathLike[str],
    after: int = 0,
    *,
    kinds: Iterable[EventKind | str] | None = None,
    poll: float = 0.1,
    stop: Stop = None,
    idle_timeout: float | None = None,
    max_line: int = DEFAULT_MAX_LINE,
) -> AsyncIterator[Event]:
    """Asyncio variant of :func:`follow`: ``async for event in follow_async(path): ...``."""
    wanted = _wanted(kinds)
    follower = Follower(path, after, max_line=max_line)
    quiet_since = time.monotonic()
    try:
        while True:
            stopping = _stopped(stop)
            events = follower.read_available()
            for event in events:
                if wanted is None or event.kind in wanted:
                    yield event
            if stopping:
                return
            now = time.monotonic()
            if events:
                quiet_since = now
            elif idle_timeout is not None and now - quiet_since >= idle_timeout:
                return
            if not events:
                await asyncio.sleep(poll)
    finally:
        follower.close()
