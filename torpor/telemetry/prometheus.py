"""The Prometheus collector: torpor's metrics computed at scrape time from each controller's projection.

Gauges (state, bytes per tag and residency, pinned host bytes, the info
metric) are read from the live projection when Prometheus scrapes; counters
and histograms (transitions, sleep and wake durations, per-tag transfers,
refusals, failures) are accumulated from events by the tracker. One collector
serves every controller attached to the same registry, so eight ranks in one
process give one family per metric. Names carry the ``torpor_`` prefix and base
units, and never clash with vLLM's own ``vllm:`` sleep metrics; the engine
and rank labels are ``torpor_engine`` and ``torpor_rank``, because vLLM's
``engine`` label on the same ``/metrics`` holds an engine index. Label names
are what OpenTelemetry's Prometheus translation makes of the OTel sink's
attributes (``torpor.engine`` -> ``torpor_engine``, ``error.type`` ->
``error_type``), so one dashboard reads either path.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from torpor.errors import DuplicateRank
from torpor.statemachine.core.events import Event
from torpor.statemachine.core.states import State
from torpor.telemetry.rankstats import RankStats
from torpor.telemetry.tracker import HostBacking, Observation, Tracker, host_backing, keeper_figures

RESIDENCIES: tuple[str, ...] = ("resident", "host", "discarded")
BASE_LABELS: tuple[str, ...] = ("torpor_engine", "torpor_rank")

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
    "torpor_tag_kept_bytes": (
        "gauge",
        ("tag",),
        "Bytes of a discarded tag kept on the host while it sleeps: tracked state no reload restores (track())",
    ),
    "torpor_pinned_host_bytes": ("gauge", (), "Pinned host memory held for backups"),
    "torpor_last_sleep_duration_seconds": ("gauge", (), "Duration of the last completed sleep"),
    "torpor_last_wake_duration_seconds": ("gauge", (), "Duration of the last completed wake"),
    "torpor_host_budget_bytes": (
        "gauge",
        (),
        "Pinned host memory the host-memory policy lets backups hold (+Inf: no budget)",
    ),
    "torpor_asleep_device_bytes": (
        "gauge",
        ("part",),
        "Device memory in use at the last sleep: in_use, tagged (torpor's tags still mapped), "
        "untagged (CUDA context, libraries, torch's default pool)",
    ),
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
        ("command", "error_type"),
        "Commands refused by the guard, by command and error class",
    ),
    "torpor_failures_total": (
        "counter",
        ("operation", "error_type"),
        "Sleeps aborted and wakes failed, by error class",
    ),
    "torpor_events_total": ("counter", ("kind",), "Events recorded, by kind"),
    # a keeper backing the allocator's host memory (torpor.keeper; docs/keeper.md): keeper_engine is its name there
    "torpor_keeper_host_bytes": (
        "gauge",
        ("keeper_engine",),
        "Host backup bytes held in keeper regions mapped into this rank",
    ),
    "torpor_keeper_backup_bytes": ("gauge", ("keeper_engine",), "Bytes of the backup published to the keeper now"),
    "torpor_keeper_up": ("gauge", ("keeper_engine",), "1 while the keeper answers this rank, 0 once it is gone"),
    "torpor_keeper_fallbacks_total": (
        "counter",
        ("keeper_engine",),
        "Host ranges left in the rank's own memory (keeper gone or over budget)",
    ),
    "torpor_keeper_adopted_bytes_total": (
        "counter",
        ("keeper_engine",),
        "Bytes adopted from a keeper's backup (backup_adopted events)",
    ),
    "torpor_keeper_adoptions_total": ("counter", ("keeper_engine",), "Backups adopted from a keeper"),
}


_COUNTERS = {
    "transition": "torpor_transitions_total",
    "transfer_bytes": "torpor_tag_transfer_bytes_total",
    "transfer_seconds": "torpor_tag_transfer_seconds_total",
    "refusal": "torpor_refusals_total",
    "failure": "torpor_failures_total",
    "event": "torpor_events_total",
    "adopted_bytes": "torpor_keeper_adopted_bytes_total",
    "adoption": "torpor_keeper_adoptions_total",
}
_HISTOGRAMS = {"sleep_seconds": "torpor_sleep_duration_seconds", "wake_seconds": "torpor_wake_duration_seconds"}
#: Gauges of the last completed sleep and wake (the tracker keeps the values; none before the first one).
LAST_GAUGES = {
    "sleep_seconds": "torpor_last_sleep_duration_seconds",
    "wake_seconds": "torpor_last_wake_duration_seconds",
}


class Sample(NamedTuple):
    """One sample of a rank, as :func:`rank_samples` computes it."""

    family: str  #: the metric family it belongs to (a key of :data:`METRICS`)
    name: str  #: the sample's own name (``<family>_bucket``, ``_count``, ``_sum`` for a histogram)
    labels: tuple[tuple[str, str], ...]  #: sorted (label, value) pairs, the engine and rank among them
    value: float
    prefix: str  #: its ``name{labels} `` text, the line before the value


#: Per-rank memo of each series' labels and line prefix, keyed by (sample name, extra labels).
SeriesCache = dict[tuple[str, tuple[tuple[str, str], ...]], tuple[tuple[tuple[str, str], ...], str]]


def _family(name: str) -> Metric:
    kind, _, doc = METRICS[name]
    if kind == "counter":
        return Metric(name.removesuffix("_total"), doc, "counter")
    if kind == "info":
        return Metric(name.removesuffix("_info"), doc, "info")
    return Metric(name, doc, kind)


def _family_header(name: str) -> str:
    """``# HELP`` and ``# TYPE`` lines as the Prometheus text format (0.0.4) writes them."""
    kind, _, doc = METRICS[name]
    kind = "gauge" if kind == "info" else kind
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


_NUMBERS: dict[float, str] = {}
_CACHE_LIMIT = 65_536


def _number(value: float) -> str:
    """The Go-style text of a float, memoised (counts and byte sizes repeat)."""
    text = _NUMBERS.get(value)
    if text is None:
        if len(_NUMBERS) > _CACHE_LIMIT:
            _NUMBERS.clear()
        text = _NUMBERS[value] = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


def keeper_key(backing: HostBacking | None) -> tuple[object, ...]:
    """What a rank's keeper samples depend on (part of the collector's cache key: they change between events)."""
    return () if backing is None else (id(backing), backing.engine, *keeper_figures(backing))


def rank_samples(tracker: Tracker, stats: RankStats, version: str, series: SeriesCache | None = None) -> list[Sample]:
    """Every sample of one rank: gauges from the live projection, counters and histograms from ``stats``.

    With a keeper backing the memory's host arena (:func:`~torpor.telemetry.tracker.host_backing`), its
    ``torpor_keeper_*`` figures, read now.

    ``series`` memoises each series' sorted labels and line prefix across scrapes (a rank's series are few).
    """
    proj = tracker.source.projection
    base = ((BASE_LABELS[0], tracker.engine), (BASE_LABELS[1], str(tracker.rank)))
    out: list[Sample] = []
    memo: SeriesCache = {} if series is None else series

    def add(family: str, name: str, extra: tuple[tuple[str, str], ...], value: float) -> None:
        known = memo.get((name, extra))
        if known is None:
            labels = tuple(sorted(base + extra))
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            known = memo[(name, extra)] = (labels, f"{name}{{{text}}} ")
        out.append(Sample(family, name, known[0], value, known[1]))

    add("torpor_info", "torpor_info", (("driver", tracker.driver), ("version", version)), 1.0)
    current = proj.state
    for state in State:
        add("torpor_state", "torpor_state", (("state", state.value),), 1.0 if state is current else 0.0)
    add("torpor_state_since_timestamp_seconds", "torpor_state_since_timestamp_seconds", (), proj.since_wall)
    for tag, usage in sorted(dict(proj.residency).items()):
        for residency in RESIDENCIES:
            value = float(getattr(usage, residency))
            add("torpor_tag_bytes", "torpor_tag_bytes", (("residency", residency), ("tag", tag)), value)
    for tag, nbytes in sorted(proj.kept.items()):
        add("torpor_tag_kept_bytes", "torpor_tag_kept_bytes", (("tag", tag),), float(nbytes))
    add("torpor_pinned_host_bytes", "torpor_pinned_host_bytes", (), float(proj.pinned_bytes))
    for metric, family in LAST_GAUGES.items():
        last = tracker.last.get(metric)
        if last is not None:
            add(family, family, (), last)
    budget = proj.host_policy.get("budget_bytes")
    add("torpor_host_budget_bytes", "torpor_host_budget_bytes", (), float("inf") if budget is None else float(budget))
    for part in ("in_use", "tagged", "untagged"):
        if part in proj.device_asleep:
            value = float(proj.device_asleep[part])
            add("torpor_asleep_device_bytes", "torpor_asleep_device_bytes", (("part", part),), value)
    add("torpor_cudagraphs", "torpor_cudagraphs", (), float(proj.graph_count))
    backing = host_backing(tracker.source)
    if backing is not None:
        for family, value in keeper_figures(backing):
            add(family, family, (("keeper_engine", backing.engine),), value)
    counters, hists = stats.snapshot()
    for metric, family in _COUNTERS.items():
        names = METRICS[family][1]
        for labels, value in sorted(counters.get(metric, {}).items()):
            add(family, family, tuple(zip(names, labels, strict=True)), value)
    for metric, family in _HISTOGRAMS.items():
        names = METRICS[family][1]
        for labels, hist in sorted(hists.get(metric, {}).items()):
            extra = tuple(zip(names, labels, strict=True))
            for le, count in hist.buckets():
                add(family, f"{family}_bucket", (*extra, ("le", le)), count)
            add(family, f"{family}_count", extra, float(sum(hist.counts)))
            add(family, f"{family}_sum", extra, hist.total)
    return out


@dataclass
class _Cached:
    key: tuple[object, ...] = ()
    samples: list[Sample] = field(default_factory=list)
    text: dict[str, str] = field(default_factory=dict)


class TorporCollector:
    """A ``prometheus_client`` collector for every tracker attached to one registry.

    Each rank's samples are computed at scrape time and kept until its next
    event, so scrapes between transitions cost almost nothing;
    :meth:`exposition` renders the text format directly (what the endpoint
    serves), :meth:`collect` feeds any registry.
    """

    def __init__(self, version: str) -> None:
        self.version = version
        self._stats: dict[Tracker, RankStats] = {}
        self._cache: dict[Tracker, _Cached] = {}
        self._series: dict[Tracker, SeriesCache] = {}
        self._lock = threading.Lock()

    def add(self, tracker: Tracker) -> None:
        """Expose ``tracker``'s source from the next scrape on; count its events from now on.

        Raises :class:`~torpor.errors.DuplicateRank` when another
        tracker with the same engine and rank is already exposed here.
        """
        with self._lock:
            if any((t.engine, t.rank) == (tracker.engine, tracker.rank) for t in self._stats if t is not tracker):
                raise DuplicateRank(tracker.engine, tracker.rank, "this Prometheus registry")
            self._stats.setdefault(tracker, RankStats())
        tracker.add_sink(self)

    def remove(self, tracker: Tracker) -> None:
        """Stop exposing ``tracker``'s source."""
        tracker.remove_sink(self)
        with self._lock:
            self._stats.pop(tracker, None)
            self._cache.pop(tracker, None)
            self._series.pop(tracker, None)

    def __len__(self) -> int:
        return len(self._stats)

    def handle(self, tracker: Tracker, event: Event, observations: list[Observation]) -> None:
        """Tracker sink: accumulate counters and histograms."""
        stats = self._stats.get(tracker)
        if stats is not None:
            stats.add(observations)
            stats.version += 1

    def _ranks(self, render: bool) -> list[_Cached]:
        with self._lock:
            trackers = list(self._stats.items())
        out = []
        for tracker, stats in trackers:
            key = (
                tracker.seq,
                tracker.source.projection.last_seq,
                stats.version,
                *keeper_key(host_backing(tracker.source)),
            )
            cached = self._cache.get(tracker)
            if cached is None or cached.key != key:
                series = self._series.setdefault(tracker, {})
                if len(series) > _CACHE_LIMIT:
                    series.clear()
                cached = _Cached(key, rank_samples(tracker, stats, self.version, series))
                self._cache[tracker] = cached
            if render and not cached.text:
                text: dict[str, list[str]] = defaultdict(list)
                for sample in cached.samples:
                    text[sample.family].append(sample.prefix + _number(sample.value) + "\n")
                cached.text = {family: "".join(lines) for family, lines in text.items()}
            out.append(cached)
        return out

    def describe(self) -> Iterator[Metric]:
        """The families this collector exposes (names only), for the registry's duplicate check."""
        for name in METRICS:
            yield _family(name)

    def collect(self) -> Iterator[Metric]:
        """Every family, from the projections and the accumulated counts."""
        families = {name: _family(name) for name in METRICS}
        for cached in self._ranks(render=False):
            for sample in cached.samples:
                families[sample.family].add_sample(sample.name, dict(sample.labels), sample.value)
        yield from families.values()

    def exposition(self) -> bytes:
        """The Prometheus text format (0.0.4) of every family, rendered directly (same text as ``generate_latest``)."""
        ranks = self._ranks(render=True)
        parts = []
        for name in METRICS:
            parts.append(_family_header(name))
            parts.extend(cached.text.get(name, "") for cached in ranks)
        return "".join(parts).encode()


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


def exposition(registry: CollectorRegistry) -> bytes:
    """torpor's families in ``registry`` as Prometheus text, rendered directly (empty when none is attached).

    The same text ``generate_latest`` gives for torpor's collector, several
    times faster: for a route of its own (say ``/torpor/metrics``) beside a
    shared registry's ``/metrics``.
    """
    with _collectors_lock:
        collector = _collectors.get(registry)
    return collector.exposition() if collector is not None else b""
