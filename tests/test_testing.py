"""Tests of torpor.testing: FakeMemory's declared capabilities and capture_events."""

from __future__ import annotations

from torpor import EventKind, SleepController
from torpor.statemachine.core.protocol import Abilities, Capability, capabilities_of
from torpor.testing import FakeMemory, capture_events


def test_fake_memory_says_it_owns_a_graph_pool() -> None:
    """FakeMemory's one capability is the graph pool (its capabilities()), and its methods meet it."""
    memory = FakeMemory({"weights": 4096})
    assert FakeMemory.capabilities() == {Capability.GRAPH_POOL}
    assert capabilities_of(memory) == {Capability.GRAPH_POOL}
    assert Abilities.of(memory).graphs is memory


def test_capture_events_collects_the_events_of_the_block_only() -> None:
    """capture_events sees the events recorded inside the block, of the kinds asked, and none after."""
    ctl = SleepController(FakeMemory({"weights": 4096}))
    with capture_events(ctl, [EventKind.SLEEP_COMPLETED]) as seen:
        ctl.sleep(1)
    ctl.wake()
    assert [e.kind for e in seen] == [EventKind.SLEEP_COMPLETED]
