"""Counters and duration histograms accumulated from one tracker's observations.

The Prometheus collector (:mod:`torpor.telemetry.prometheus`) and the OpenTelemetry
sink read these at scrape time; they hold plain numbers, no client objects.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.utils import floatToGoString

from torpor.telemetry.tracker import Observation

#: Histogram buckets for sleep and wake durations (seconds): a cached wake on a
#: fast link takes tens of milliseconds, a first sleep that pins gigabytes seconds.
DURATION_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

_LE: tuple[str, ...] = tuple(str(floatToGoString(b)) for b in (*DURATION_BUCKETS, float("inf")))  # type: ignore[no-untyped-call]


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
        for bound, count in zip(_LE, self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


@dataclass
class RankStats:
    """Counters and histograms accumulated from one tracker's observations."""

    counters: dict[str, dict[tuple[str, ...], float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    histograms: dict[str, dict[tuple[str, ...], Histogram]] = field(default_factory=lambda: defaultdict(dict))
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0

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
