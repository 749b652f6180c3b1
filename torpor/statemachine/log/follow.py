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
from typing import Protocol

from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.reader import DEFAULT_MAX_LINE, decode_lines
from torpor.statemachine.log.tail import Tail

logger = logging.getLogger("torpor.hooks")


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


class Follower(Tail):
    """Reads a rank's event log incrementally; :meth:`read_available` never blocks.

    ``after`` is the last sequence number already seen (0: from the start);
    :attr:`last_seq` advances as events are returned, so a consumer that
    stores it can resume later with ``Follower(path, after=last_seq)``. It is
    the log's one tailer (:class:`~torpor.statemachine.log.tail.Tail`) with the
    log's own decoder; warnings go to the ``torpor.hooks`` logger.
    """

    def __init__(self, path: str | os.PathLike[str], after: int = 0, *, max_line: int = DEFAULT_MAX_LINE) -> None:
        super().__init__(path, decode_lines, after, max_line=max_line, log=logger)


class _Pace:
    """One follow loop's bookkeeping, shared by :func:`follow` and :func:`follow_async` (they differ in how they wait)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        after: int,
        kinds: Iterable[EventKind | str] | None,
        stop: Stop,
        idle_timeout: float | None,
        max_line: int,
    ) -> None:
        self.wanted = None if kinds is None else frozenset(EventKind(k) for k in kinds)
        self.follower = Follower(path, after, max_line=max_line)
        self.stop = stop
        self.idle_timeout = idle_timeout
        self.quiet_since = time.monotonic()

    def step(self) -> tuple[list[Event], bool, bool]:
        """(the new events wanted, whether to end after them, whether to wait before the next step)."""
        stopping = _stopped(self.stop)  # read before the log: what is on disk when stop is set still comes out
        events = self.follower.read_available()
        wanted = [e for e in events if self.wanted is None or e.kind in self.wanted]
        if stopping:
            return wanted, True, False
        now = time.monotonic()
        if events:
            self.quiet_since = now
            return wanted, False, False
        idle = self.idle_timeout is not None and now - self.quiet_since >= self.idle_timeout
        return wanted, idle, not idle


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
    pace = _Pace(path, after, kinds, stop, idle_timeout, max_line)
    wait = getattr(stop, "wait", None)
    try:
        while True:
            events, done, idle = pace.step()
            yield from events
            if done:
                return
            if idle:
                if isinstance(stop, threading.Event) and callable(wait):
                    wait(poll)
                else:
                    time.sleep(poll)
    finally:
        pace.follower.close()


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
    pace = _Pace(path, after, kinds, stop, idle_timeout, max_line)
    try:
        while True:
            events, done, idle = pace.step()
            for event in events:
                yield event
            if done:
                return
            if idle:
                await asyncio.sleep(poll)
    finally:
        pace.follower.close()
