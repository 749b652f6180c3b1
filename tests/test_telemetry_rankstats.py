"""Tests for torpor.telemetry.rankstats: the counters and histograms the collectors read."""

from __future__ import annotations

import threading

from torpor.telemetry.rankstats import DURATION_BUCKETS, Histogram, RankStats
from torpor.telemetry.tracker import Observation


def test_histogram_buckets_are_cumulative_and_end_with_inf() -> None:
    """A histogram's buckets count every value at or below each bound and end with +Inf."""
    hist = Histogram()
    for value in (0.001, 0.005, 0.3, 500.0):
        hist.observe(value)
    buckets = dict(hist.buckets())
    assert buckets["0.005"] == 2.0
    assert buckets["0.5"] == 3.0
    assert buckets["120.0"] == 3.0
    assert buckets["+Inf"] == 4.0
    assert len(buckets) == len(DURATION_BUCKETS) + 1
    assert hist.total == 0.001 + 0.005 + 0.3 + 500.0


def test_rank_stats_split_durations_from_counters() -> None:
    """Sleep and wake durations go to histograms, every other metric to counters, by labels."""
    stats = RankStats()
    stats.add(
        [
            Observation("sleep_seconds", ("1",), 0.2),
            Observation("sleep_seconds", ("1",), 0.4),
            Observation("refusals", ("sleep", "InvalidTransition"), 1.0),
            Observation("refusals", ("sleep", "InvalidTransition"), 1.0),
        ]
    )
    counters, hists = stats.snapshot()
    assert counters == {"refusals": {("sleep", "InvalidTransition"): 2.0}}
    assert hists["sleep_seconds"][("1",)].total == 0.2 + 0.4


def test_snapshot_is_a_copy_that_later_adds_do_not_change() -> None:
    """A snapshot taken for one scrape keeps its numbers while more observations arrive."""
    stats = RankStats()
    stats.add([Observation("wake_seconds", ("all",), 1.0), Observation("events", ("sleep_started",), 1.0)])
    counters, hists = stats.snapshot()
    stats.add([Observation("wake_seconds", ("all",), 2.0), Observation("events", ("sleep_started",), 1.0)])
    assert counters["events"][("sleep_started",)] == 1.0
    assert hists["wake_seconds"][("all",)].total == 1.0


def test_concurrent_adds_lose_no_observation() -> None:
    """Observations added from several threads at once are all counted."""
    stats = RankStats()

    def add() -> None:
        for _ in range(2000):
            stats.add([Observation("events", ("x",), 1.0), Observation("sleep_seconds", ("1",), 0.01)])

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counters, hists = stats.snapshot()
    assert counters["events"][("x",)] == 8000.0
    assert sum(hists["sleep_seconds"][("1",)].counts) == 8000
