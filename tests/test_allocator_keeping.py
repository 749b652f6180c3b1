"""Tests of torpor.allocator.kept_ranges.keeping on SimDriver: ranges of a tag kept across a discard, counted, replayed, rolled back."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.support import RigMaker, samples, value
from torpor import EventKind, State
from torpor.allocator import AllocatorError, TaggedAllocator
from torpor.allocator.kept_ranges.keeping import merged
from torpor.allocator.kept_ranges.ranges import KeptRange
from torpor.statemachine import replay
from torpor.telemetry import attach
from torpor.testrig import GRANULE as G


class Ranges:
    """A keep source over fixed ranges; records each fresh() call."""

    def __init__(self, ranges: list[KeptRange]) -> None:
        self._ranges = ranges
        self.fresh_calls: list[bool] = []

    def ranges(self) -> list[KeptRange]:
        return list(self._ranges)

    def fresh(self, inside: Callable[[int, int], bool]) -> None:
        self.fresh_calls.append(all(inside(r.address, r.nbytes) for r in self._ranges))


def weights(alloc: TaggedAllocator) -> tuple[int, bytes, int, bytes]:
    """Two weights allocations with random bytes: (address, bytes) each."""
    a, b = alloc.allocate(4 * G, "weights"), alloc.allocate(2 * G, "weights")
    da, db = os.urandom(4 * G), os.urandom(2 * G)
    alloc.write(a, da)
    alloc.write(b, db)
    return a, da, b, db


def test_kept_ranges_survive_a_level_2_discard_and_the_rest_is_discarded(make_rig: RigMaker) -> None:
    """Level 2 discards weights, yet the tracked ranges come back at the wake; the untracked bytes do not."""
    rig = make_rig("unslabbed")
    ctl = rig.control(engine="e")
    a, da, b, db = weights(rig.allocator)
    source = Ranges([KeptRange("inv_freq", a + 100, 1000), KeptRange("cache", b + G, 512)])
    ctl.track(source)
    ctl.sleep(2)
    assert ctl.projection.residency["weights"].discarded == 6 * G
    assert rig.allocator.kept_bytes("weights") == 1512
    ctl.wake()
    assert rig.allocator.read(a + 100, 1000) == da[100:1100]
    assert rig.allocator.read(b + G, 512) == db[G : G + 512]
    assert rig.allocator.read(a, 100) != da[:100]  # discarded: fresh memory
    assert source.fresh_calls == [True]
    assert rig.allocator.kept_bytes() == 0  # the copy goes once the wake stands


def test_without_tracking_a_level_2_wake_loses_the_same_ranges(make_rig: RigMaker) -> None:
    """The control: the same ranges, untracked, do not survive level 2 (what a reload then cannot mend)."""
    rig = make_rig("unslabbed")
    ctl = rig.control(engine="e")
    a, da, _, _ = weights(rig.allocator)
    ctl.sleep(2)
    ctl.wake()
    assert rig.allocator.read(a + 100, 1000) != da[100:1100]


def test_kept_bytes_are_in_the_events_the_replay_and_the_metric(tmp_path: Path, make_rig: RigMaker) -> None:
    """tag_released and tag_restored carry ``kept``; replaying the log gives the live projection; the gauge shows it."""
    log = tmp_path / "e.jsonl"
    rig = make_rig("unslabbed")
    ctl = rig.control(log=log, engine="e")
    registry = CollectorRegistry()
    attach(ctl, registry=registry)
    a, _, _, _ = weights(rig.allocator)
    ctl.track(Ranges([KeptRange("inv_freq", a, 3000)]))
    ctl.sleep(2)
    released = [e.data for e in ctl.events() if e.kind is EventKind.TAG_RELEASED and e.data.tag == "weights"]
    assert released[-1].kept == 3000 and released[-1].action == "discard"
    assert ctl.projection.kept == {"weights": 3000}
    assert replay(log).to_dict() == ctl.projection.to_dict()
    got = samples(registry)
    assert value(got, "torpor_tag_kept_bytes", torpor_engine="e", torpor_rank="0", tag="weights") == 3000
    ctl.wake()
    restored = [e.data for e in ctl.events() if e.kind is EventKind.TAG_RESTORED and e.data.tag == "weights"]
    assert (restored[-1].kept, restored[-1].source) == (3000, "fresh")
    assert ctl.projection.kept == {}
    assert replay(log).to_dict() == ctl.projection.to_dict()
    assert not [k for k in samples(registry) if k[0] == "torpor_tag_kept_bytes"]


def test_level_1_keeps_nothing_extra(make_rig: RigMaker) -> None:
    """A tag offloaded at level 1 has its backup: nothing is kept, and no event carries ``kept``."""
    rig = make_rig("unslabbed")
    ctl = rig.control(engine="e")
    a, da, _, _ = weights(rig.allocator)
    ctl.track(Ranges([KeptRange("inv_freq", a, 3000)]))
    ctl.sleep(1)
    assert rig.allocator.kept_bytes() == 0
    ctl.wake()
    assert rig.allocator.read(a, 4 * G) == da
    assert all("kept" not in e.data for e in ctl.events())


def test_a_resident_discard_keeps_the_ranges_too(make_rig: RigMaker) -> None:
    """discard(["weights"]) of resident weights keeps the tracked ranges; the wake that names them copies them back."""
    rig = make_rig("unslabbed")
    ctl = rig.control(engine="e")
    a, da, _, _ = weights(rig.allocator)
    ctl.track(Ranges([KeptRange("inv_freq", a + G, 64)]))
    ctl.discard(["weights"])
    assert ctl.state is State.PARTIALLY_AWAKE and rig.allocator.kept_bytes("weights") == 64
    ctl.wake(["weights"])
    assert rig.allocator.read(a + G, 64) == da[G : G + 64]


def test_ranges_outside_the_tag_are_skipped_and_overlaps_merged() -> None:
    """Only ranges inside one of the tag's allocations are kept; overlapping ones are copied once."""
    live = [(1000, 100, 0), (5000, 100, 0)]
    wanted = [KeptRange("a", 1010, 20), KeptRange("b", 1020, 30), KeptRange("out", 90, 5), KeptRange("c", 5000, 100)]
    ranges, names = merged(wanted, live)
    assert ranges == [(1010, 40, 0), (5000, 100, 0)]
    assert names == ["a", "b", "c"]
    assert merged([KeptRange("spans", 1090, 20)], live) == ([], [])


def test_a_failed_keep_leaves_the_tag_resident_and_the_sleep_rolled_back(make_rig: RigMaker) -> None:
    """A copy that fails while keeping the ranges fails the release: the sleep rolls back and the bytes stay."""
    rig = make_rig("unslabbed")
    ctl = rig.control(engine="e")
    a, da, _, _ = weights(rig.allocator)
    ctl.track(Ranges([KeptRange("inv_freq", a, 128)]))
    rig.driver.fail("copy_d2h")
    with pytest.raises(Exception, match="tracked ranges not kept"):
        ctl.sleep(2)
    assert ctl.state is State.AWAKE
    assert rig.allocator.kept_bytes() == 0
    assert rig.allocator.read(a, 4 * G) == da


def test_a_failed_copy_back_fails_the_wake_and_keeps_the_copy(make_rig: RigMaker) -> None:
    """A copy back that fails fails the wake (the tag released again); a retried wake copies the ranges back."""
    rig = make_rig("unslabbed")
    ctl = rig.control(engine="e")
    a, da, _, _ = weights(rig.allocator)
    ctl.track(Ranges([KeptRange("inv_freq", a + 8, 256)]))
    ctl.sleep(2)
    rig.driver.fail("copy_h2d")
    with pytest.raises(AllocatorError, match="kept ranges not copied back"):
        ctl.wake()
    assert ctl.state is State.ASLEEP_L2
    assert rig.allocator.kept_bytes("weights") == 256
    ctl.wake()
    assert rig.allocator.read(a + 8, 256) == da[8:264]


def test_untrack_and_close_give_the_host_memory_back(make_rig: RigMaker) -> None:
    """An untracked source is no longer kept; close frees a kept copy's pinned memory."""
    rig = make_rig("unslabbed")
    ctl = rig.control(engine="e")
    a, _, _, _ = weights(rig.allocator)
    source = rig.allocator.track(Ranges([KeptRange("inv_freq", a, 128)]))
    remove = rig.allocator.keep("weights", Ranges([KeptRange("other", a + G, 128)]))
    remove()
    ctl.sleep(2)
    assert rig.allocator.kept_names("weights") == ["inv_freq"]
    assert source is not None
    rig.allocator.close()
    assert rig.driver.host_used == 0
