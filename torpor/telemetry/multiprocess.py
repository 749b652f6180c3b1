"""Multiprocess mode: each worker writes torpor's metrics to ``PROMETHEUS_MULTIPROC_DIR``; the API server reads them.

vLLM's workers are separate processes, so a scrape-time collector in a worker
is never reached by the server's ``/metrics``. In prometheus-client's
multiprocess mode every process writes its samples to files that a
``MultiProcessCollector`` in the serving process merges. This module keeps one
set of ordinary metric objects per process (the same names and labels as
:mod:`torpor.telemetry.prometheus`) and updates them on each event. Every
series carries ``engine`` and ``rank``, and gauges use the ``livemostrecent``
mode, so each rank's value comes out as that rank wrote it, never summed over
processes; counters and histograms are summed per label set, which is exact
because one rank is one process (a restarted rank adds to its predecessor's
counts, as a counter should). Call :func:`mark_process_dead` when a worker exits.

**With no directory set** (``vllm serve`` with a single API server sets none), the
process that selects torpor first, the API server, calls :func:`provide_directory`:
it makes a temporary directory of torpor's own, names it in ``TORPOR_METRICS_DIR``
(inherited by the engine core and the workers) and registers a
``MultiProcessCollector`` of that directory in the global registry, the one vLLM's
``/metrics`` serves while ``PROMETHEUS_MULTIPROC_DIR`` is unset. It does not set
``PROMETHEUS_MULTIPROC_DIR`` there: vLLM would then serve only the merged files and
its own front-end metrics, made in memory, would vanish from ``/metrics``. A worker
writes torpor's series to that directory with prometheus-client's file-backed values
(:func:`_file_values`), whatever mode its prometheus-client was imported in.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from prometheus_client import REGISTRY
from prometheus_client import multiprocess as _mp
from prometheus_client import values as _values
from prometheus_client.metrics import Counter, Gauge, Histogram
from prometheus_client.registry import CollectorRegistry

from torpor.errors import DuplicateRank
from torpor.statemachine.core.events import (
    Event,
    EventKind,
    TagBackedUp,
    TagDiscarded,
    TagReleased,
    TagRestored,
    TagRolledBack,
)
from torpor.statemachine.core.protocol import TagUsage
from torpor.statemachine.core.states import State
from torpor.switches import env_text
from torpor.telemetry.rankstats import DURATION_BUCKETS
from torpor.telemetry.samples import BASE_LABELS, LAST_GAUGES, METRICS
from torpor.telemetry.tracker import HostBacking, Observation, Tracker, host_backing, keeper_figures

ENV = "PROMETHEUS_MULTIPROC_DIR"
#: torpor's own directory for worker metrics when ``PROMETHEUS_MULTIPROC_DIR`` is unset (see the module doc).
TORPOR_ENV = "TORPOR_METRICS_DIR"
GAUGE_MODE: Literal["livemostrecent"] = "livemostrecent"


def directory() -> str | None:
    """Where this process's metric files go: ``PROMETHEUS_MULTIPROC_DIR``, else ``TORPOR_METRICS_DIR``, else None."""
    return os.environ.get(ENV) or os.environ.get(ENV.lower()) or env_text(TORPOR_ENV)


def enabled() -> bool:
    """True when a metrics directory is named: ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's switch) or torpor's."""
    return directory() is not None


class _Provided:
    """The directory :func:`provide_directory` made in this process (removed at exit, like vLLM's own)."""

    tmp: tempfile.TemporaryDirectory[str] | None = None
    collector: Any = None


_provided = _Provided()


def provide_directory(registry: CollectorRegistry = REGISTRY) -> str | None:
    """Give the workers a metrics directory when none is named, served through ``registry``; the path, or None.

    None (nothing done) when ``PROMETHEUS_MULTIPROC_DIR`` or ``TORPOR_METRICS_DIR`` is set
    already (the operator's, vLLM's, or a parent's). Call it in the serving process before
    the workers start: they inherit ``TORPOR_METRICS_DIR``.
    """
    with _metrics_lock:
        if directory() is not None:
            return None
        _provided.tmp = tempfile.TemporaryDirectory(prefix="torpor-metrics-")
        os.environ[TORPOR_ENV] = _provided.tmp.name
        _provided.collector = _mp.MultiProcessCollector(registry, path=_provided.tmp.name)  # type: ignore[no-untyped-call]
        return _provided.tmp.name


def withdraw_directory(registry: CollectorRegistry = REGISTRY) -> None:
    """Undo :func:`provide_directory` in this process (the collector, the variable, the directory)."""
    with _metrics_lock:
        if _provided.tmp is None:
            return
        if _provided.collector is not None:
            registry.unregister(_provided.collector)
        if env_text(TORPOR_ENV) == _provided.tmp.name:
            os.environ.pop(TORPOR_ENV, None)
        _provided.tmp.cleanup()
        _provided.tmp = _provided.collector = None


_file_class: Any = None


@contextmanager
def _file_values() -> Iterator[None]:
    """Make the metric children created inside file-backed (prometheus-client's ``MultiProcessValue``).

    prometheus-client picks its value class once, at import, from ``PROMETHEUS_MULTIPROC_DIR``;
    a worker writing to torpor's directory (or one that imported it before the variable
    was set) has in-memory values, which no other process can read. The file values
    name their file from ``PROMETHEUS_MULTIPROC_DIR`` when they open it, so it is set
    here to the directory (this is a worker: the serving process never writes).
    Called with ``_metrics_lock`` held.
    """
    global _file_class  # noqa: PLW0603 - one file-backed value class per process, as prometheus-client keeps its own
    if getattr(_values.ValueClass, "_multiprocess", False):
        yield
        return
    path = directory()
    if path is None:
        yield
        return
    os.environ.setdefault(ENV, path)
    if _file_class is None:
        _file_class = _values.MultiProcessValue()  # type: ignore[no-untyped-call]
    previous = _values.ValueClass
    _values.ValueClass = _file_class
    try:
        yield
    finally:
        _values.ValueClass = previous


def _labels(name: str) -> list[str]:
    return [*BASE_LABELS, *METRICS[name][1]]


class _Metrics:
    """The process's metric objects (created once: prometheus-client refuses duplicates)."""

    def __init__(self) -> None:
        def gauge(name: str) -> Gauge:
            return Gauge(name, METRICS[name][2], _labels(name), registry=None, multiprocess_mode=GAUGE_MODE)

        def counter(name: str) -> Counter:
            return Counter(name, METRICS[name][2], _labels(name), registry=None)

        def histogram(name: str) -> Histogram:
            return Histogram(name, METRICS[name][2], _labels(name), registry=None, buckets=DURATION_BUCKETS)

        self.info = Gauge(
            "torpor_info",
            METRICS["torpor_info"][2],
            [*BASE_LABELS, "version", "driver"],
            registry=None,
            multiprocess_mode=GAUGE_MODE,
        )
        self.gauges = {
            name: gauge(name)
            for name in (
                "torpor_state",
                "torpor_state_since_timestamp_seconds",
                "torpor_tag_bytes",
                "torpor_pinned_host_bytes",
                "torpor_host_budget_bytes",
                "torpor_asleep_device_bytes",
                "torpor_cudagraphs",
                "torpor_last_sleep_duration_seconds",
                "torpor_last_wake_duration_seconds",
                "torpor_keeper_host_bytes",
                "torpor_keeper_backup_bytes",
                "torpor_keeper_up",
            )
        }
        #: A host backing's fallback count: a counter, advanced by what it grew since last written.
        self.keeper_fallbacks = counter("torpor_keeper_fallbacks_total")
        self.counters = {
            "transition": counter("torpor_transitions_total"),
            "transfer_bytes": counter("torpor_tag_transfer_bytes_total"),
            "transfer_seconds": counter("torpor_tag_transfer_seconds_total"),
            "refusal": counter("torpor_refusals_total"),
            "failure": counter("torpor_failures_total"),
            "event": counter("torpor_events_total"),
            "adopted_bytes": counter("torpor_keeper_adopted_bytes_total"),
            "adoption": counter("torpor_keeper_adoptions_total"),
        }
        self.histograms = {
            "sleep_seconds": histogram("torpor_sleep_duration_seconds"),
            "wake_seconds": histogram("torpor_wake_duration_seconds"),
        }


_metrics: _Metrics | None = None
_metrics_lock = threading.Lock()
_ranks: set[tuple[str, int]] = set()  # (engine, rank) pairs this process writes


def _process_metrics() -> _Metrics:
    global _metrics  # noqa: PLW0603 - one set of metric objects per process, by prometheus-client's design
    with _metrics_lock:
        if _metrics is None:
            _metrics = _Metrics()
        return _metrics


class MultiprocessSink:
    """Tracker sink that writes one rank's metrics to the multiprocess files on every event."""

    def __init__(self, version: str, engine: str, rank: int) -> None:
        key = (engine, rank)
        with _metrics_lock:
            if key in _ranks:
                raise DuplicateRank(engine, rank, f"the multiprocess directory of process {os.getpid()}")
            _ranks.add(key)
        self._key = key
        self.version = version
        self.metrics = _process_metrics()
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}
        self._info: tuple[str, ...] | None = None
        self._state: State | None = None
        self._usage: dict[str, TagUsage] = {}
        self._backing: HostBacking | None = None  # the host backing whose fallbacks are counted
        self._fallbacks = 0  # its fallbacks written so far
        self._followed: HostBacking | None = None  # the host backing read after each event (see _watch)
        self._unfollow: Callable[[], None] | None = None

    def close(self) -> None:
        """Let another controller with this engine and rank attach in this process (the files keep their values)."""
        if self._unfollow is not None:
            self._unfollow()
            self._unfollow = None
        with _metrics_lock:
            _ranks.discard(self._key)

    def _child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            with _metrics_lock, _file_values():
                child = self._children[key] = metric.labels(*labels)
        return child

    def _set(self, name: str, labels: tuple[str, ...], value: float) -> None:
        if self._last.get((name, labels)) != value:
            self._child(self.metrics.gauges[name], labels).set(value)
            self._last[(name, labels)] = value

    def prime(self, tracker: Tracker) -> None:
        """Write the current gauges once (at attach), before any event."""
        self._sync(tracker)
        backing = host_backing(tracker.source)
        if backing is not None:
            self._write_keeper(tracker, backing)

    def handle(self, tracker: Tracker, event: Event, observations: list[Observation]) -> None:
        """Tracker sink: count, observe, and bring the gauges this event can change up to date."""
        base = (tracker.engine, str(tracker.rank))
        for obs in observations:
            counter = self.metrics.counters.get(obs.metric)
            if counter is not None:
                self._child(counter, (*base, *obs.labels)).inc(obs.value)
            else:
                self._child(self.metrics.histograms[obs.metric], (*base, *obs.labels)).observe(obs.value)
            last = LAST_GAUGES.get(obs.metric)
            if last is not None:
                self._set(last, base, obs.value)
        if isinstance(event.data, _TAG_PAYLOADS):
            tag = event.data.tag
            usage = tracker.fold.residency.get(tag)
            if usage is not None:
                self._set_tag(base, tag, usage)
            self._sync_state(tracker, base)
        elif event.kind is not EventKind.REFUSED and event.kind is not EventKind.HOOK_DECISION:
            self._sync(tracker)
        self._watch(tracker)

    def _watch(self, tracker: Tracker) -> None:
        """Write a host backing's figures; one newly found is also followed: read after each event it handled.

        A keeper backing publishes (and retracts) in its own subscription to the controller, which
        may come after telemetry's (vLLM's wiring attaches telemetry before the keeper's loader runs).
        The subscription made here, from inside a delivery, comes after the backing's: its figures are
        written once it has acted on the event. Never from :meth:`prime` (the tracker's lock is held
        there, and subscribing takes the controller's: the order a delivery takes them in reversed).
        """
        backing = host_backing(tracker.source)
        if backing is not self._followed:
            if self._unfollow is not None:
                self._unfollow()
                self._unfollow = None
            self._followed = backing
            if backing is not None:
                self._unfollow = tracker.source.subscribe(lambda _event: self._write_keeper(tracker, backing))
        if backing is not None:
            self._write_keeper(tracker, backing)

    def _write_keeper(self, tracker: Tracker, backing: HostBacking) -> None:
        if backing is not self._backing:
            self._backing, self._fallbacks = backing, 0
        labels = (tracker.engine, str(tracker.rank), backing.engine)
        for name, value in keeper_figures(backing):
            if name in self.metrics.gauges:
                self._set(name, labels, value)
        fallbacks = self._child(self.metrics.keeper_fallbacks, labels)  # made now: the series is 0 before any
        grown = backing.fallbacks - self._fallbacks
        if grown > 0:
            fallbacks.inc(grown)
            self._fallbacks = backing.fallbacks

    def _set_tag(self, base: tuple[str, str], tag: str, usage: TagUsage) -> None:
        if self._usage.get(tag) is usage:  # TagUsage is frozen: the same object means the same bytes
            return
        self._usage[tag] = usage
        self._set("torpor_tag_bytes", (*base, tag, "resident"), float(usage.resident))
        self._set("torpor_tag_bytes", (*base, tag, "host"), float(usage.host))
        self._set("torpor_tag_bytes", (*base, tag, "discarded"), float(usage.discarded))

    def _sync_state(self, tracker: Tracker, base: tuple[str, str]) -> None:
        proj = tracker.fold
        if proj.state is not self._state:
            for state in State:
                self._set("torpor_state", (*base, state.value), 1.0 if state is proj.state else 0.0)
            self._state = proj.state
        self._set("torpor_state_since_timestamp_seconds", base, proj.since_wall)

    def _sync(self, tracker: Tracker) -> None:
        proj = tracker.fold
        base = (tracker.engine, str(tracker.rank))
        info = (*base, self.version, tracker.driver)
        if info != self._info:
            if self._info is not None:
                self._child(self.metrics.info, self._info).set(0)
            self._child(self.metrics.info, info).set(1)
            self._info = info
        self._sync_state(tracker, base)
        for tag, usage in proj.residency.items():
            self._set_tag(base, tag, usage)
        self._set("torpor_pinned_host_bytes", base, float(proj.pinned_bytes))
        budget = proj.host_policy.get("budget_bytes")
        self._set("torpor_host_budget_bytes", base, float("inf") if budget is None else float(budget))
        for part, value in proj.device_asleep.items():
            if part in ("in_use", "tagged", "untagged"):
                self._set("torpor_asleep_device_bytes", (*base, part), float(value))
        self._set("torpor_cudagraphs", base, float(proj.graph_count))
        for metric, name in LAST_GAUGES.items():
            if metric in tracker.last:
                self._set(name, base, tracker.last[metric])


#: Events that change one tag's residency and nothing else but, perhaps, the state.
_TAG_PAYLOADS = (TagBackedUp, TagReleased, TagRestored, TagRolledBack, TagDiscarded)


def multiprocess_registry(path: str | None = None) -> CollectorRegistry:
    """A registry that merges every process's files in ``path`` (default :func:`directory`: ``PROMETHEUS_MULTIPROC_DIR``, else torpor's)."""
    registry = CollectorRegistry()
    _mp.MultiProcessCollector(registry, path=path or directory())  # type: ignore[no-untyped-call]
    return registry


def mark_process_dead(pid: int, path: str | None = None) -> None:
    """Drop a dead worker's live gauges (call from the process that serves ``/metrics``; ``path``: :func:`directory`)."""
    _mp.mark_process_dead(pid, path or directory())  # type: ignore[no-untyped-call]
