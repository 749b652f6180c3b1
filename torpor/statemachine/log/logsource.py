"""A log source: an event log written by another process, replayed then tailed, handed to subscribers.

``LogSource(path)`` reads the log (all segments) into a projection, then
polls for appended lines and hands each new event to its subscribers, so
``serve(LogSource(path), port)`` (or ``serve(path, port)``) exposes
``/metrics``, ``/state`` and ``/events`` for an engine running elsewhere on the
host, without touching it. It reads through the log's one tailer
(:class:`~torpor.statemachine.log.tail.Tail`, as :class:`~torpor.statemachine.log.follow.Follower`),
like ``torpor log follow`` and :func:`~torpor.statemachine.log.follow.follow`: only
complete lines, rotation seen as rotation (renamed segments read in order,
pruned ones skipped from a snapshot), each new byte read once; and hands each
event to its subscribers through the one fan-out (:class:`~torpor.statemachine.log.fanout.Fanout`).

A bad line stops the source there: :attr:`LogSource.error` holds the
``LogCorrupted`` error (file and line), it is logged once, the projection stays
at the last good event, and the endpoint says so (``/state`` answers 503). It
keeps polling: a line repaired in place is read on the next poll; otherwise it
stays stuck until restarted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from torpor.errors import BadArgument, NoEventLog, TorporError
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.fanout import Fanout
from torpor.statemachine.log.follow import Follower
from torpor.statemachine.log.segments import segments
from torpor.statemachine.projection.view import Projection, follow_on

logger = logging.getLogger("torpor.telemetry")


def resolve_log(
    path: str | os.PathLike[str],
    engine: str | None = None,
    rank: int | None = None,
    *,
    hint: str = "pick one with --engine and --rank",
) -> Path:
    """The event log ``path`` names: itself, or the one ``*.jsonl`` log in a directory.

    ``engine`` and ``rank`` narrow a directory's logs to ``ENGINE.rankN.jsonl``.
    Raises ``FileNotFoundError`` when there is no such log, ``ValueError``
    naming the logs and ``hint`` when a directory holds several.
    """
    path = Path(path)
    if path.is_dir():
        logs = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if engine is not None:
            logs = [p for p in logs if p.name.startswith(f"{engine}.rank")]
        if rank is not None:
            logs = [p for p in logs if p.name.endswith(f".rank{rank}.jsonl")]
        if not logs:
            narrowed = "" if engine is None and rank is None else " of that engine and rank"
            msg = f"no event log (*.jsonl){narrowed} in directory {path}"
            raise NoEventLog(msg)
        if len(logs) > 1:
            names = ", ".join(p.name for p in logs)
            msg = f"{path} holds {len(logs)} event logs ({names}); {hint}"
            raise BadArgument(msg)
        return logs[0]
    if not segments(path):
        msg = f"no event log at {path}"
        raise NoEventLog(msg)
    return path


class LogSource:
    """Replays and follows one event log file; meets the telemetry :class:`~torpor.telemetry.Source` protocol.

    A log that cannot be read at all (a bad line before the first poll) raises
    from the constructor; a bad line met later sets :attr:`error`.
    """

    def __init__(self, path: str | os.PathLike[str], *, poll: float = 0.25, keep_events: int = 10_000) -> None:
        self.path = Path(path)
        if not segments(self.path):
            msg = f"no event log at {self.path}"
            raise NoEventLog(msg)
        self.poll = poll
        self.projection = Projection()
        #: The error the log is stuck at (a ``LogCorrupted`` naming file and line), or None while it reads.
        self.error: TorporError | None = None
        self._recent: deque[Event] = deque(maxlen=keep_events)
        self._subscribers: Fanout[Callable[[Event], None]] = Fanout(logger)
        self._lock = threading.RLock()
        self._follower = Follower(self.path)
        self._stop = threading.Event()
        while self._read(raise_errors=True):  # the follower hands the events before a bad line first, then raises
            pass
        self._thread = threading.Thread(target=self._follow, name=f"torpor-log-source:{self.path.name}", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> str:
        """The engine named by the log's events."""
        return self.projection.engine or self.path.name.split(".rank")[0]

    @property
    def rank(self) -> int:
        """The rank named by the log's events."""
        return self.projection.rank

    @property
    def last_seq(self) -> int:
        """Sequence number of the last event read."""
        return self.projection.last_seq

    def events(self, after: int = 0) -> list[Event]:
        """Recent events (up to ``keep_events``) above ``after``."""
        with self._lock:
            return [e for e in self._recent if e.seq > after]

    def subscribe(
        self, callback: Callable[[Event], None], kinds: Iterable[EventKind | str] | None = None
    ) -> Callable[[], None]:
        """Call ``callback(event)`` for each new event (of ``kinds``); return an unsubscribe function."""
        with self._lock:  # not while events are being delivered
            remove = self._subscribers.subscribe(callback, kinds)

        def unsubscribe() -> None:
            with self._lock:
                remove()

        return unsubscribe

    def refresh(self) -> int:
        """Read what was appended since the last look; return how many events were new (0 while stuck)."""
        return self._read(raise_errors=False)

    def close(self) -> None:
        """Stop following the file."""
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            self._follower.close()

    def _read(self, *, raise_errors: bool) -> int:
        with self._lock:
            try:
                events = self._follower.read_available()
            except TorporError as exc:
                if raise_errors:
                    raise
                if self.error is None or str(exc) != str(self.error):
                    logger.error(
                        "%s: stuck at a bad line, serving the state as of event #%d: %s", self.path, self.last_seq, exc
                    )
                self.error = exc
                return 0
            if self.error is not None and events:
                logger.warning("%s: reading again after %s", self.path, self.error)
                self.error = None
            for event in events:
                self._take(event)
            return len(events)

    def _take(self, event: Event) -> None:
        if event.seq == 1 and event.kind is not EventKind.SNAPSHOT and self.projection.last_seq:
            self._recent.clear()  # the log started anew (#1 after others): the old events are another run's
        self.projection = follow_on(self.projection, event)
        self._recent.append(event)
        self._subscribers.publish(event)  # a subscriber that raises is logged; it never stops the follower

    def _follow(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.refresh()
            except Exception:  # anything else (an unreadable directory): say so and keep following
                logger.exception("following %s failed; retrying", self.path)


def wall_problem(event: Event) -> str | None:
    """Why ``event``'s wall time cannot be shown as a local date (a huge finite ``wall``), or None when it can.

    Readers that print or plot times (``torpor log``, ``torpor plot``) show such
    an event without its time and exit non-zero: the log is bad.
    """
    try:
        time.localtime(event.wall)
    except (OverflowError, OSError, ValueError) as exc:
        return f"event #{event.seq} ({event.kind.value}) has a wall time that is no date: {event.wall!r} ({exc})"
    return None
