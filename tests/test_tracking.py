"""Tests of torpor.statemachine.machine.tracking: the controller's track entry point and its refusals."""

from __future__ import annotations

import pytest

from torpor import SleepController, TrackRefused
from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
from torpor.allocator.kept_ranges.ranges import KeptRange
from torpor.testing import FakeMemory


class Nothing:
    """A keep source with no ranges."""

    def ranges(self) -> list[KeptRange]:
        return []

    def fresh(self, inside: object) -> None:
        return None


def test_track_is_refused_by_a_memory_that_cannot_keep_ranges() -> None:
    """A memory without track() (FakeMemory) refuses, naming the memory."""
    ctl = SleepController(FakeMemory({"weights": 10}))
    with pytest.raises(TrackRefused, match="FakeMemory cannot keep ranges"):
        ctl.track(Nothing())


def test_track_is_refused_for_a_tag_the_policy_never_discards() -> None:
    """A tag offloaded at every level and not deferrable needs nothing kept: refused, saying why."""
    alloc = TaggedAllocator(SimDriver(16 << 20, granularity=64 * 1024), host=HostPolicy(prepin=False))
    ctl = SleepController(alloc)
    with pytest.raises(TrackRefused, match="never discards it"):
        ctl.track(Nothing(), "runtime")
    source = ctl.track(Nothing(), "weights")
    assert isinstance(source, Nothing)
    alloc.close()
