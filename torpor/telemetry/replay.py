"""A telemetry source that follows an event log written by another process (replay, then tail).

``LogSource(path)`` replays the log (all segments) into a projection, then
polls the active file for appended lines and hands each new event to its
subscribers, so ``serve(LogSource(path), port)`` (or ``serve(path, port)``)
exposes ``/metrics``, ``/state`` and ``/events`` for an engine running
elsewhere on the host, without touching it. Only complete lines are read (a
line being written is picked up on the next poll); a rotation is noticed by
the file changing identity, and the new segments are read from the last
sequence number seen.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path

from torpor.statemachine.events import Event, EventKind
from torpor.statemachine.log import DEFAULT_MAX_LINE, decode_line, read_events_file, segments
from torpor.statemachine.projection import Projection

logger = logging.getLogger("torpor.telemetry")


def resolve_log(path: str | os.PathLike[str], engine: str | None = None, rank: int | None = None) -> Path:
    """The log file to plot: ``path`` itself, or the one ``ENGINE.rankN.jsonl`` in a log directory."""
    path = Path(path)
    if not path.is_dir():
        return path
    files = sorted(path.glob("*.rank*.jsonl"))
    if engine is not None:
        files = [f for f in files if f.name.startswith(f"{engine}.rank")]
    if rank is not None:
        files = [f for f in files if f.name.endswith(f".rank{rank}.jsonl")]
    if len(files) != 1:
        names = ", ".join(f.name for f in files) or "none"
        msg = f"{path} holds {len(files)} matching event logs ({names}); pick one with --engine and --rank"
        raise ValueError(msg)
    return files[0]


class LogSource:
    """Replays and follows one event log file; meets the telemetry :class:`~torpor.telemetry.Source` protocol."""

    def __init__(self, path: str | os.PathLike[str], *, poll: float = 0.25, keep_events: int = 10_000) -> None:
        self.path = Path(path)
        if not segments(self.path):
            msg = f"no event log at {self.path}"
            raise FileNotFoundError(msg)
        self.poll = poll
        self.projection = Projection()
        self._recent: deque[Event] = deque(maxlen=keep_events)
        self._subscribers: list[Callable[[Event], None]] = []
        self._lock = threading.RLock()
        self._identity: tuple[int, int] | None = None
        self._offset = 0
        self._stop = threading.Event()
        self._catch_up()
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
        wanted = None if kinds is None else frozenset(EventKind(k) for k in kinds)

        def entry(event: Event) -> None:
            if wanted is None or event.kind in wanted:
                callback(event)

        with self._lock:
            self._subscribers.append(entry)

        def unsubscribe() -> None:
            with self._lock:
                if entry in self._subscribers:
                    self._subscribers.remove(entry)

        return unsubscribe

    def refresh(self) -> int:
        """Read what was appended since the last look; return how many events were new."""
        with self._lock:
            try:
                stat = self.path.stat()
            except FileNotFoundError:
                return 0  # between a rotation's rename and the new file
            if (stat.st_dev, stat.st_ino) != self._identity or stat.st_size < self._offset:
                return self._catch_up()
            if stat.st_size == self._offset:
                return 0
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read(stat.st_size - self._offset)
            end = data.rfind(b"\n") + 1
            new = 0
            for line in data[:end].split(b"\n")[:-1]:
                event = decode_line(line, str(self.path), 0, DEFAULT_MAX_LINE)
                new += self._take(event)
            self._offset += end
            return new

    def close(self) -> None:
        """Stop following the file."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _catch_up(self) -> int:
        """Read the rotated segments, then one snapshot of the active file, keeping events above the last seen."""
        with self._lock:
            files = segments(self.path)
            active = self.path if self.path.exists() else None
            new = 0
            for segment in files if active is None else files[:-1]:
                for event in read_events_file(segment):
                    new += self._take(event)
            if active is None:
                return new
            with open(active, "rb") as fh:
                stat = os.fstat(fh.fileno())
                data = fh.read()
            end = data.rfind(b"\n") + 1
            for lineno, line in enumerate(data[:end].split(b"\n")[:-1], 1):
                new += self._take(decode_line(line, str(active), lineno, DEFAULT_MAX_LINE))
            self._identity, self._offset = (stat.st_dev, stat.st_ino), end
            return new

    def _take(self, event: Event) -> int:
        if event.seq <= self.projection.last_seq:
            return 0
        self.projection.apply(event)
        self._recent.append(event)
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:  # a subscriber must never stop the follower
                logger.exception("subscriber %r failed on event #%d", callback, event.seq)
        return 1

    def _follow(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.refresh()
            except Exception:  # a bad line: say so and keep following
                logger.exception("following %s failed; retrying", self.path)
