"""torpor.telemetry.samples: the metric families every sink exposes and a rank's samples as named records."""

from __future__ import annotations

from torpor import SleepController
from torpor.telemetry import METRICS, Tracker
from torpor.telemetry.rankstats import RankStats
from torpor.telemetry.samples import BASE_LABELS, COUNTERS, HISTOGRAMS, LAST_GAUGES, rank_samples
from torpor.testing import FakeMemory

TAGS = {"weights": 4000, "kv_cache": 8000, "cudagraph": 300, "runtime": 50}


def test_rank_samples_are_records_read_by_name() -> None:
    """A rank's samples name their family, sample name, sorted labels, value and line prefix (its name and labels)."""
    controller = SleepController(FakeMemory(TAGS), engine="e", rank=0)
    got = rank_samples(Tracker(controller), RankStats(), "1.0")
    awake = [s for s in got if s.family == "torpor_state" and ("state", "awake") in s.labels]
    assert [(s.name, s.value) for s in awake] == [("torpor_state", 1.0)]
    assert awake[0].prefix == 'torpor_state{state="awake",torpor_engine="e",torpor_rank="0"} '
    assert all(s.labels == tuple(sorted(s.labels)) for s in got)


def test_every_family_a_rank_samples_is_in_the_table_with_its_labels() -> None:
    """Each sample's family is a METRICS family, and its labels are the base labels, the family's own, and le for buckets."""
    controller = SleepController(FakeMemory(TAGS), engine="e", rank=0)
    controller.sleep(1)
    controller.wake()
    for sample in rank_samples(Tracker(controller), RankStats(), "1.0"):
        extra = set(METRICS[sample.family][1]) | ({"le"} if sample.name.endswith("_bucket") else set())
        assert {k for k, _ in sample.labels} == set(BASE_LABELS) | extra, sample
    tracked = {*COUNTERS.values(), *HISTOGRAMS.values(), *LAST_GAUGES.values()}
    assert tracked <= set(METRICS)
