"""Tests for torpor.statemachine.machine.sleeping: the order a sleep releases its tags in, and what a failure then loses."""

from __future__ import annotations

import threading

import pytest

from torpor import Policy, SleepController, State
from torpor.errors import MemoryOperationFailed
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.machine.localgroup import LocalGroup
from torpor.testing import FakeMemory

SIZES = {"weights": 4096, "kv_cache": 8192, "workspace": 256, "cudagraph": 1024}
DISCARD_FIRST = Policy(discard_first=True)


def _memory_steps(memory: FakeMemory) -> list[tuple[str, str]]:
    return [c for c in memory.calls if c[0] in ("backup", "release")]


def test_by_default_offloaded_tags_are_released_before_any_discarded_tag() -> None:
    """Without discard_first the sleep backs up, releases the offloaded tags, then the discarded ones."""
    memory = FakeMemory(SIZES)
    SleepController(memory).sleep(1)
    steps = _memory_steps(memory)
    assert steps == [
        ("backup", "cudagraph"),
        ("backup", "weights"),
        ("release", "cudagraph"),
        ("release", "weights"),
        ("release", "kv_cache"),
        ("release", "workspace"),
    ]


def test_with_discard_first_the_discarded_tags_are_released_before_the_backup() -> None:
    """Policy(discard_first=True): the discarded tags go first (the driver's work on them overlaps the copies)."""
    memory = FakeMemory(SIZES)
    ctl = SleepController(memory, policy=DISCARD_FIRST)
    ctl.sleep(1)
    steps = _memory_steps(memory)
    assert steps[:2] == [("release", "kv_cache"), ("release", "workspace")]
    assert steps[2:] == [
        ("backup", "cudagraph"),
        ("backup", "weights"),
        ("release", "cudagraph"),
        ("release", "weights"),
    ]
    kinds = [e.kind for e in ctl.events() if e.kind in (EventKind.TAG_RELEASED, EventKind.TAG_BACKED_UP)]
    assert kinds[:2] == [EventKind.TAG_RELEASED, EventKind.TAG_RELEASED]
    assert ctl.state is State.ASLEEP_L1
    ctl.wake()
    assert ctl.state is State.AWAKE


def test_a_backup_failing_after_the_discard_rolls_back_and_names_what_was_lost() -> None:
    """discard_first and a failed backup: awake again, the offloaded tags' content intact, the discarded ones named lost."""
    memory = FakeMemory(SIZES, failures=[("backup", "weights")])
    weights = memory.write("weights")
    ctl = SleepController(memory, policy=DISCARD_FIRST)
    with pytest.raises(MemoryOperationFailed):
        ctl.sleep(1)
    aborted = ctl.events()[-1]
    assert aborted.kind is EventKind.SLEEP_ABORTED
    assert sorted(aborted.data["lost"]) == ["kv_cache", "workspace"]
    assert "kv_cache" in aborted.data["reason"]
    assert ctl.state is State.AWAKE
    assert memory.content("weights") == weights
    assert all(u.resident for u in memory.usage().values())


def test_in_a_group_discard_first_still_votes_before_anything_is_discarded() -> None:
    """With a group the ranks agree before a discard, so discard_first keeps the offloaded tags first there."""
    members = LocalGroup.make(2, name="tp")
    memories = [FakeMemory(SIZES) for _ in members]
    ctls = [
        SleepController(m, engine="e", rank=r, fsync=False, group=g, policy=DISCARD_FIRST)
        for r, (m, g) in enumerate(zip(memories, members, strict=True))
    ]
    threads = [threading.Thread(target=c.sleep, args=(1,)) for c in ctls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for ctl, memory in zip(ctls, memories, strict=True):
        assert ctl.state is State.ASLEEP_L1
        steps = _memory_steps(memory)
        assert steps[-2:] == [("release", "kv_cache"), ("release", "workspace")]
