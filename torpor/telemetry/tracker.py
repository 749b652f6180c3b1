"""One subscriber per controller: folds its events into observations that every telemetry sink shares.

Telemetry only reads. A :class:`Tracker` subscribes to a source (a
:class:`~torpor.SleepController`, or anything with ``projection``, ``events``
and ``subscribe``), keeps a private fold of the events so it knows the state
before and after each one, turns each event into :class:`Observation` records
(a transition, a duration, a transfer, a refusal) and hands them to its sinks
(the Prometheus counters, the multiprocess files, OpenTelemetry). It never
calls a command on the source; with no tracker attached nothing changes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

from torpor.statemachine.core.events import (
    Event,
    EventKind,
    Opened,
    Refused,
    SleepAborted,
    SleepCompleted,
    TagBackedUp,
    TagRestored,
    WakeCompleted,
    WakeFailed,
)
from torpor.statemachine.core.payloads import BackupAdopted
from torpor.statemachine.core.states import State
from torpor.statemachine.log.fanout import Fanout
from torpor.statemachine.projection.view import Projection

logger = logging.getLogger("torpor.telemetry")

#: Directions of a per-tag copy.
DEVICE_TO_HOST = "device_to_host"
HOST_TO_DEVICE = "host_to_device"


@runtime_checkable
class Source(Protocol):
    """What telemetry reads: a live projection, recent events, and a subscription."""

    @property
    def projection(self) -> Projection:
        """The live projection."""
        ...

    def events(self, after: int = 0) -> list[Event]:
        """Recent events with a sequence number above ``after``."""
        ...

    def subscribe(
        self, callback: Callable[[Event], None], kinds: Iterable[EventKind | str] | None = None
    ) -> Callable[[], None]:
        """Call ``callback(event)`` after each event; return an unsubscribe function."""
        ...


@runtime_checkable
class HostBacking(Protocol):
    """What telemetry reads of a host backing: a host-memory provider that keeps an engine's backups outside it.

    :class:`torpor.keeper.KeeperBacking` is one; telemetry never imports it: the
    keeper installs it as its allocator's host provider (``memory.host_provider``)
    and telemetry finds it there (:func:`host_backing`) and reads these figures.
    """

    engine: str  # the keeper's name for the engine
    kept_bytes: int  # bytes of keeper memory mapped under the host arena now
    published_bytes: int  # bytes of the backup published to the keeper now
    fallbacks: int  # host ranges that stayed the engine's own memory
    gone: str | None  # why the keeper no longer answers (None: it does)


def host_backing(source: object) -> HostBacking | None:
    """The host backing under ``source``'s memory (``source.memory.host_provider``), or None: no such provider."""
    provider = getattr(getattr(source, "memory", None), "host_provider", None)
    return provider if isinstance(provider, HostBacking) else None


def keeper_figures(backing: HostBacking) -> tuple[tuple[str, float], ...]:
    """A host backing's gauges and counter now: (family, value) of each ``torpor_keeper_*`` series it has."""
    return (
        ("torpor_keeper_host_bytes", float(backing.kept_bytes)),
        ("torpor_keeper_backup_bytes", float(backing.published_bytes)),
        ("torpor_keeper_up", 0.0 if backing.gone else 1.0),
        ("torpor_keeper_fallbacks_total", float(backing.fallbacks)),
    )


class Observation(NamedTuple):
    """One measurement derived from one event: ``metric`` names what it feeds, ``labels`` its label values."""

    metric: str
    labels: tuple[str, ...]
    value: float


class Sink(Protocol):
    """Something fed by a tracker (Prometheus counters, multiprocess files, OpenTelemetry)."""

    def handle(self, tracker: Tracker, event: Event, observations: list[Observation]) -> None:
        """Take one event and what it measured; called under the tracker's lock, in event order."""
        ...


def woken_label(tags: Any) -> str:
    """The ``tags`` label of a wake: ``all`` or the requested tags, sorted and comma-joined."""
    if tags is None:
        return "all"
    return ",".join(sorted(str(t) for t in tags)) or "none"


def interpret(event: Event, before: State, after: State) -> Iterator[Observation]:
    """The measurements one event carries, given the state before and after it.

    Metrics: ``transition`` (from, to), ``sleep_seconds`` (level),
    ``wake_seconds`` (woken tags), ``transfer_bytes`` and ``transfer_seconds``
    (tag, direction), ``refusal`` (command, error class), ``failure``
    (operation, error class), ``event`` (kind), ``adopted_bytes`` and ``adoption``
    (the keeper's engine name).
    """
    kind = event.kind
    yield Observation("event", (kind.value,), 1.0)
    if before is not after and kind not in (EventKind.OPENED, EventKind.SNAPSHOT):
        yield Observation("transition", (before.value, after.value), 1.0)
    match event.data:
        case SleepCompleted(incomplete=None, level=level, seconds=seconds):
            yield Observation("sleep_seconds", ("" if level is None else str(level),), float(seconds))
        case WakeCompleted(tags=tags, seconds=seconds):
            yield Observation("wake_seconds", (woken_label(tags),), float(seconds))
        case TagBackedUp(tag=tag, bytes=nbytes, seconds=seconds):
            yield Observation("transfer_bytes", (tag, DEVICE_TO_HOST), float(nbytes))
            yield Observation("transfer_seconds", (tag, DEVICE_TO_HOST), float(seconds))
        case TagRestored(source="host", tag=tag, bytes=nbytes, seconds=seconds, checked=checked):
            yield Observation("transfer_bytes", (tag, HOST_TO_DEVICE), float(nbytes))
            yield Observation("transfer_seconds", (tag, HOST_TO_DEVICE), float(seconds))
            if checked:
                yield Observation("checked_bytes", (tag,), float(checked))
        case Refused(command=command, error=error):
            yield Observation("refusal", (command, _error_label(error)), 1.0)
        case SleepAborted(error=error):
            yield Observation("failure", ("sleep", _error_label(error)), 1.0)
        case WakeFailed(error=error):
            yield Observation("failure", ("wake", _error_label(error)), 1.0)
        case BackupAdopted(engine=engine, bytes=nbytes):
            yield Observation("adopted_bytes", (engine,), float(nbytes))
            yield Observation("adoption", (engine,), 1.0)


def _error_label(error: str | None) -> str:
    return "TorporError" if error is None else error


#: Observations whose last value the tracker keeps (the "last sleep / last wake" gauges).
LAST_METRICS = frozenset({"sleep_seconds", "wake_seconds"})


def _last_durations(source: Source, upto: int) -> dict[str, float]:
    """The last completed sleep's and wake's seconds among the source's recent events up to ``upto``."""
    found: dict[str, float] = {}
    for event in reversed(source.events(0)):
        if event.seq > upto:
            continue
        match event.data:
            case SleepCompleted(incomplete=None, seconds=seconds):
                found.setdefault("sleep_seconds", float(seconds))
            case WakeCompleted(seconds=seconds):
                found.setdefault("wake_seconds", float(seconds))
        if len(found) == len(LAST_METRICS):
            break
    return found


def _driver_of(source: Source) -> str:
    """The memory class: from the latest ``opened`` event, else the source's ``memory`` attribute."""
    for event in reversed(source.events(0)):
        if isinstance(event.data, Opened) and "memory" in event.data:
            return event.data.memory
    memory = getattr(source, "memory", None)
    return type(memory).__name__ if memory is not None else "unknown"


class Tracker:
    """Subscribes to one source and feeds its sinks, in event order, exactly once per event.

    Counting starts at attach time: the private fold starts from a copy of the
    source's projection and events up to its ``last_seq`` are not counted again.
    """

    def __init__(self, source: Source, sinks: Iterable[Sink] = ()) -> None:
        self.source = source
        self.sinks: Fanout[Sink] = Fanout(logger, "telemetry sink")
        for sink in sinks:
            self.sinks.subscribe(sink)
        self._lock = threading.Lock()
        self._pending: list[Event] | None = []
        self.fold = Projection()
        self.seq = 0
        self.driver = "unknown"
        #: The last completed sleep's and wake's seconds (``sleep_seconds``, ``wake_seconds``), once known.
        self.last: dict[str, float] = {}
        proj = source.projection
        #: Label values, fixed for the tracker's life.
        self.engine = str(getattr(source, "engine", "") or proj.engine or "default")
        self.rank = int(getattr(source, "rank", proj.rank))
        self._unsubscribe = source.subscribe(self._on_event)
        start = Projection.from_dict(source.projection.to_dict())
        driver = _driver_of(source)
        last = _last_durations(source, start.last_seq)
        with self._lock:
            self.fold, self.seq, self.driver = start, start.last_seq, driver
            self.last.update(last)
            pending, self._pending = self._pending or [], None
            for event in pending:
                self._handle(event)

    def add_sink(self, sink: Sink) -> None:
        """Feed ``sink`` from the next event on (after calling its ``prime(tracker)``, if it has one)."""
        with self._lock:
            prime = getattr(sink, "prime", None)
            if callable(prime):
                prime(self)
            self.sinks.subscribe(sink)

    def remove_sink(self, sink: Sink) -> None:
        """Stop feeding ``sink``."""
        with self._lock:
            self.sinks.unsubscribe(sink)

    def close(self) -> None:
        """Unsubscribe from the source; sinks keep what they have."""
        self._unsubscribe()

    def _on_event(self, event: Event) -> None:
        with self._lock:
            if self._pending is not None:
                self._pending.append(event)
                return
            self._handle(event)

    def _handle(self, event: Event) -> None:
        if event.seq <= self.seq:
            return
        self.seq = event.seq
        before = self.fold.state
        self.fold.apply(event)
        if isinstance(event.data, Opened) and "memory" in event.data:
            self.driver = event.data.memory
        observations = list(interpret(event, before, self.fold.state))
        for obs in observations:
            if obs.metric in LAST_METRICS:
                self.last[obs.metric] = obs.value
        # a telemetry sink that raises is logged; it never breaks the others or the controller
        self.sinks.deliver(event, lambda sink: sink.handle(self, event, observations))
