"""The Prometheus collector: torpor's metrics computed at scrape time from each controller's projection.

Gauges (state, bytes per tag and residency, pinned host bytes, the info
metric) are read from the live projection when Prometheus scrapes; counters
and histograms (transitions, sleep and wake durations, per-tag transfers,
refusals, failures) are accumulated from events by the tracker. One collector
serves every controller attached to the same registry, so eight ranks in one
process give one family per metric. Names carry the ``torpor_`` prefix and base
units, and never clash with vLLM's own ``vllm:`` sleep metrics.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from torpor.statemachine.events import Event
from torpor.statemachine.states import State
from torpor.telemetry.tracker import Observation, Tracker

#: Histogram buckets for sleep and wake durations (seconds): a cached wake on a
#: fast link takes tens of milliseconds, a first sleep that pins gigabytes seconds.
DURATION_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RESIDENCIES: tuple[str, ...] = ("resident", "host", "discarded")
BASE_LABELS: tuple[str, ...] = ("engine", "rank")

#: Every metric family this module exposes: name (as exposed) -> (type, extra labels, help).
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "torpor_info": ("info", ("version", "driver"), "torpor version and the memory driver (memory class) of each rank"),
    "torpor_state": ("gauge", ("state",), "Current sleep state: 1 for the state the rank is in, 0 for the others"),
    "torpor_state_since_timestamp_seconds": (
        "gauge",
        (),
        "Unix time at which the rank entered its current state",
    ),
    "torpor_tag_bytes": (
        "gauge",
        ("tag", "residency"),
        "Bytes of each memory tag by residency (resident, host, discarded)",
    ),
    "torpor_pinned_host_bytes": ("gauge", (), "Pinned host memory held for backups"),
    "torpor_cudagraphs": ("gauge", (), "CUDA graphs captured into the graph pool and not released"),
    "torpor_transitions_total": (
        "counter",
        ("from_state", "to_state"),
        "State transitions, by source and target state",
    ),
    "torpor_sleep_duration_seconds": ("histogram", ("level",), "Duration of completed sleeps, by level"),
    "torpor_wake_duration_seconds": (
        "histogram",
        ("tags",),
        "Duration of completed wakes, by woken tags (all, or the named tags)",
    ),
    "torpor_tag_transfer_bytes_total": (
        "counter",
        ("tag", "direction"),
        "Bytes copied per tag between device and host",
    ),
    "torpor_tag_transfer_seconds_total": (
        "counter",
        ("tag", "direction"),
        "Seconds spent copying per tag between device and host",
    ),
    "torpor_refusals_total": (
        "counter",
        ("command", "reason"),
        "Commands refused by the guard, by command and error class",
    ),
    "torpor_failures_total": ("counter", ("operation", "reason"), "Sleeps aborted and wakes failed, by error class"),
    "torpor_events_total": ("counter", ("kind",), "Events recorded, by kind"),
}


@dataclass
class Histogram:
    """Non-cumulative bucket counts, a sum and a count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        """Count one value in its bucket."""
        self.counts[bisect.bisect_left(DURATION_BUCKETS, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs ending with ``+Inf``."""
        out, running = [], 0
        for bound, count in zip((*DURATION_BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append((str(floatToGoString(bound)), float(running)))  # type: ignore[no-untyped-call]
        return out


@dataclass
class RankStats:
    """Counters and histograms accumulated from one tracker's observations."""

    counters: dict[str, dict[tuple[str, ...], float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    histograms: dict[str, dict[tuple[str, ...], Histogram]] = field(default_factory=lambda: defaultdict(dict))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, observations: Iterable[Observation]) -> None:
        """Fold observations in."""
        with self.lock:
            for obs in observations:
                if obs.metric in ("sleep_seconds", "wake_seconds"):
                    hist = self.histograms[obs.metric].get(obs.labels)
                    if hist is None:
                        hist = self.histograms[obs.metric][obs.labels] = Histogram()
                    hist.observe(obs.value)
                else:
                    self.counters[obs.metric][obs.labels] += obs.value

    def snapshot(self) -> tuple[dict[str, dict[tuple[str, ...], float]], dict[str, dict[tuple[str, ...], Histogram]]]:
        """A consistent copy for one scrape."""
        with self.lock:
            counters = {m: dict(v) for m, v in self.counters.items()}
            hists = {
                m: {k: Histogram(list(h.counts), h.total) for k, h in v.items()} for m, v in self.histograms.items()
            }
        return counters, hists


_COUNTERS = {
    "transition": "torpor_transitions_total",
    "transfer_bytes": "torpor_tag_transfer_bytes_total",
    "transfer_seconds": "torpor_tag_transfer_seconds_total",
    "refusal": "torpor_refusals_total",
    "failure": "torpor_failures_total",
    "event": "torpor_events_total",
}
_HISTOGRAMS = {"sleep_seconds": "torpor_sleep_duration_seconds", "wake_seconds": "torpor_wake_duration_seconds"}


def _family(name: str) -> Metric:
    kind, extra, doc = METRICS[name]
    labels = [*BASE_LABELS, *extra]
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    if kind == "histogram":
        return HistogramMetricFamily(name, doc, labels=labels)
    if kind == "info":
        return InfoMetricFamily(name.removesuffix("_info"), doc, labels=list(BASE_LABELS))
    return GaugeMetricFamily(name, doc, labels=labels)


class TorporCollector:
    """A ``prometheus_client`` collector for every tracker attached to one registry."""

    def __init__(self, version: str) -> None:
        self.version = version
        self._stats: dict[Tracker, RankStats] = {}
        self._lock = threading.Lock()

    def add(self, tracker: Tracker) -> None:
        """Expose ``tracker``'s source from the next scrape on; count its events from now on."""
        with self._lock:
            self._stats.setdefault(tracker, RankStats())
        tracker.add_sink(self)

    def remove(self, tracker: Tracker) -> None:
        """Stop exposing ``tracker``'s source."""
        tracker.remove_sink(self)
        with self._lock:
            self._stats.pop(tracker, None)

    def __len__(self) -> int:
        return len(self._stats)

    def handle(self, tracker: Tracker, event: Event, observations: list[Observation]) -> None:
        """Tracker sink: accumulate counters and histograms."""
        stats = self._stats.get(tracker)
        if stats is not None:
            stats.add(observations)

    def describe(self) -> Iterator[Metric]:
        """The families this collector exposes (names only), for the registry's duplicate check."""
        for name in METRICS:
            yield _family(name)

    def collect(self) -> Iterator[Metric]:
        """Compute every family from the projections and the accumulated counts."""
        families: dict[str, Any] = {name: _family(name) for name in METRICS}
        with self._lock:
            trackers = list(self._stats.items())
        for tracker, stats in trackers:
            _collect_rank(families, tracker, stats, self.version)
        yield from families.values()


def _collect_rank(families: dict[str, Any], tracker: Tracker, stats: RankStats, version: str) -> None:
    proj = tracker.source.projection
    base = [tracker.engine, str(tracker.rank)]
    families["torpor_info"].add_metric(base, {"version": version, "driver": tracker.driver})
    current = proj.state
    state_family = families["torpor_state"]
    for state in State:
        state_family.add_metric([*base, state.value], 1.0 if state is current else 0.0)
    families["torpor_state_since_timestamp_seconds"].add_metric(base, proj.since_wall)
    tag_family = families["torpor_tag_bytes"]
    for tag, usage in sorted(dict(proj.residency).items()):
        tag_family.add_metric([*base, tag, "resident"], float(usage.resident))
        tag_family.add_metric([*base, tag, "host"], float(usage.host))
        tag_family.add_metric([*base, tag, "discarded"], float(usage.discarded))
    families["torpor_pinned_host_bytes"].add_metric(base, float(proj.pinned_bytes))
    families["torpor_cudagraphs"].add_metric(base, float(len(proj.graphs)))
    counters, hists = stats.snapshot()
    for metric, name in _COUNTERS.items():
        family = families[name]
        for labels, value in sorted(counters.get(metric, {}).items()):
            family.add_metric([*base, *labels], value)
    for metric, name in _HISTOGRAMS.items():
        family = families[name]
        for labels, hist in sorted(hists.get(metric, {}).items()):
            family.add_metric([*base, *labels], hist.buckets(), hist.total)


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, TorporCollector] = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def collector_for(registry: CollectorRegistry, version: str) -> TorporCollector:
    """The one torpor collector of ``registry``, registering it on first use."""
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = TorporCollector(version)
            registry.register(collector)  # type: ignore[arg-type]
            _collectors[registry] = collector
        return collector


def release_collector(registry: CollectorRegistry) -> None:
    """Unregister the torpor collector of ``registry`` once no tracker uses it."""
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is not None and not len(collector):
            registry.unregister(collector)  # type: ignore[arg-type]
            del _collectors[registry]
