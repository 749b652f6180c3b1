"""The Prometheus collector: torpor's metrics computed at scrape time from each controller's projection.

The families and a rank's samples are :mod:`torpor.telemetry.samples`'s; this
module registers them with a ``prometheus_client`` registry and renders the
text format. Gauges (state, bytes per tag and residency, pinned host bytes, the info
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

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from torpor.errors import DuplicateRank
from torpor.statemachine.core.events import Event
from torpor.telemetry.rankstats import RankStats
from torpor.telemetry.samples import METRICS, Sample, SeriesCache, keeper_key, rank_samples
from torpor.telemetry.tracker import Observation, Tracker, host_backing


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
