"""The recorder: typed payloads made events, written to the log, folded into the projection, handed to subscribers.

Every event of a controller goes through :meth:`Recorder.record`, which takes
a payload built by its fields' names (``TagReleased(tag=..., bytes=...)``, so
the type checker sees every producer's fields), stamps it with the next
sequence number, appends it to the log, applies it to the projection and
publishes it; a log rotation's snapshot is recorded the same way. The state is
the projection's and nothing else holds a copy (see docs/architecture.md
"Invariant: the state is the projection's").
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable

from torpor.errors import ControllerClosed, LogWriteFailed, TorporError
from torpor.statemachine.core.events import Closed, Event, EventKind, Snapshot, stamp
from torpor.statemachine.core.fields import Payload
from torpor.statemachine.core.states import State
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.fanout import Fanout
from torpor.statemachine.log.interrupts import UNINTERRUPTED
from torpor.statemachine.log.reader import read_current
from torpor.statemachine.projection.view import Projection, project

logger = logging.getLogger("torpor")

Subscriber = Callable[[Event], None]


class Recorder:
    """One controller's events: the log, the projection they fold into, the recent ones kept, the subscribers.

    Opening an existing log reads it from the snapshot that opens its newest
    file (:func:`~torpor.statemachine.log.reader.read_current`), not its whole
    history. ``lock`` is held while an event is recorded and delivered: hold it
    to read the projection as one event left it; ``changed`` is notified after each event.
    """

    def __init__(self, engine: str, rank: int, log: EventLog | None, keep_events: int) -> None:
        self.engine = engine
        self.rank = rank
        self.log = log
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.subscribers: Fanout[Subscriber] = Fanout(logger, "torpor subscriber")
        self._recent: list[Event] = []
        self._keep_events = keep_events
        self.projection = Projection(engine=engine, rank=rank)
        self.seq = 0  # the last event's sequence number
        self.closed_at = 0  # the sequence number of the ``closed`` event, once closed
        if log is not None and log.last_seq:  # from the newest snapshot: a restart costs one file's read
            self.projection = project(read_current(log.path, log.max_line))
            self.seq = log.last_seq

    def record(self, payload: Payload) -> Event:
        """Record ``payload`` as the next event: log, projection, subscribers; a Ctrl-C is raised after, never between."""
        with UNINTERRUPTED, self.lock:
            if self.closed_at:
                raise ControllerClosed(f"record {payload.kind}", self.engine, self.rank, self.closed_at)
            event = stamp(payload, self.seq + 1, self.engine, self.rank)
            if self.log is not None:
                self.log.append(event)
            self.seq = event.seq
            self.projection.apply(event)
            delivered = [event]
            if self.log is not None and event.kind is not EventKind.SNAPSHOT and self.log.needs_rotation():
                snap = stamp(Snapshot(projection=self.projection.to_dict()), self.seq + 1, self.engine, self.rank)
                try:
                    self.log.rotate(snap)
                except (OSError, TorporError):  # the active file keeps growing; the next try is max_bytes later
                    logger.exception("torpor: rotating %s failed; appending to the active file", self.log.path)
                else:
                    self.seq = snap.seq
                    self.projection.apply(snap)
                    delivered.append(snap)  # subscribers and events() see every sequence number, as the log does
            self._recent.extend(delivered)
            if len(self._recent) > self._keep_events:
                del self._recent[: len(self._recent) - self._keep_events]
            self.changed.notify_all()
            for sent in delivered:
                self.subscribers.publish(sent)  # a subscriber that raises is logged; it never breaks the controller
            return event

    def close(self) -> None:
        """Record ``closed``, mark the recorder closed and close the log: all or none. Closing twice does nothing."""
        with UNINTERRUPTED, self.lock:
            if self.closed_at:
                return
            try:
                event = self.record(Closed(state=self.projection.state.value))
                self.closed_at = event.seq
            except LogWriteFailed:
                logger.exception("torpor: recording 'closed' failed; the log is closed anyway")
                self.closed_at = self.seq or 1
            if self.log is not None:
                self.log.close()

    # -- reading --------------------------------------------------------------

    def events(self, after: int = 0) -> list[Event]:
        """Recent events (up to ``keep_events``) with a sequence number above ``after``."""
        with self.lock:
            return [e for e in self._recent if e.seq > after]

    def subscribe(self, callback: Subscriber, kinds: Iterable[EventKind | str] | None = None) -> Callable[[], None]:
        """Call ``callback(event)`` after each event (of ``kinds``); return an unsubscribe function."""
        with self.lock:  # not while an event is being delivered
            remove = self.subscribers.subscribe(callback, kinds)

        def unsubscribe() -> None:
            with self.lock:
                remove()

        return unsubscribe

    def wait_for(self, state: State | str, timeout: float | None = None) -> bool:
        """Block until the projection is in ``state``; False on timeout."""
        target = State(state)
        with self.changed:
            return self.changed.wait_for(lambda: self.projection.state is target, timeout)

    async def wait_for_async(self, state: State | str, timeout: float | None = None) -> bool:
        """Asyncio variant of :meth:`wait_for`; never blocks the event loop."""
        target = State(state)
        loop = asyncio.get_running_loop()
        reached: asyncio.Future[bool] = loop.create_future()

        def on_event(_: Event) -> None:
            if self.projection.state is target:
                loop.call_soon_threadsafe(lambda: None if reached.done() else reached.set_result(True))

        unsubscribe = self.subscribe(on_event)
        try:
            if self.projection.state is target:
                return True
            try:
                return await asyncio.wait_for(reached, timeout)
            except TimeoutError:
                return False
        finally:
            unsubscribe()
