"""Tests for torpor.statemachine.machine.rollback: progress records, each compensation's events, and a discard that fails."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from torpor import SleepController, State
from torpor.errors import MemoryOperationFailed, NotRecovered, TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.policy import Action
from torpor.statemachine.core.protocol import Transfer
from torpor.statemachine.machine.rollback import SleepPhase, SleepProgress, discard_failed
from torpor.testing import FakeMemory

SIZES = {"weights": 4096, "kv_cache": 8192, "cudagraph": 1024, "runtime": 512}


def _after(ctl: SleepController, seq: int) -> list[str]:
    return [e.kind.value for e in ctl.events(after=seq)]


def test_lost_names_tags_released_without_a_backup() -> None:
    """SleepProgress.lost() lists discarded tags released so far and a discarded tag whose release was under way."""
    plan = {"weights": Action.OFFLOAD, "kv_cache": Action.DISCARD, "workspace": Action.DISCARD}
    progress = SleepProgress(1, plan, 0.0)
    progress.released = [Transfer("weights", 1, 0.0), Transfer("kv_cache", 2, 0.0)]
    assert progress.lost() == ["kv_cache"]
    progress.failed = "workspace"
    assert progress.lost() == ["kv_cache", "workspace"]
    progress.failed = "weights"  # an offloaded tag has its backup: nothing lost
    assert progress.lost() == ["kv_cache"]


def test_sleep_phases_are_an_enum_written_as_the_words_logs_hold() -> None:
    """A sleep's phases are SleepPhase members, starting at backup, each written as the word sleep_aborted's reason opens with."""
    assert [str(p) for p in SleepPhase] == ["backup", "release", "group", "recording"]
    assert SleepProgress(1, {}, 0.0).phase is SleepPhase.BACKUP
    assert f"{SleepPhase.RELEASE} failed" == "release failed"


def test_abort_sleep_maps_back_newest_first_then_records_the_abort() -> None:
    """A sleep failing in its release phase restores what it released, newest first, then sleep_aborted."""
    ctl = SleepController(FakeMemory(SIZES, failures=[("release", "kv_cache")]))
    seq = ctl.last_seq
    with pytest.raises(MemoryOperationFailed):
        ctl.sleep(1)
    events = ctl.events(after=seq)
    released = [e.data["tag"] for e in events if e.kind is EventKind.TAG_RELEASED]
    restored = [e.data["tag"] for e in events if e.kind is EventKind.TAG_RESTORED]
    assert restored == list(reversed(released)) and released
    assert all(e.data["source"] == "rollback" for e in events if e.kind is EventKind.TAG_RESTORED)
    assert events[-1].kind is EventKind.SLEEP_ABORTED
    assert events[-1].data["reason"].startswith("release failed:")
    assert ctl.state is State.AWAKE


def test_fail_wake_releases_again_then_records_wake_failed() -> None:
    """A wake failing part-way releases what it mapped (tag_rolled_back each) and ends in wake_failed, asleep again."""
    memory = FakeMemory(SIZES)
    ctl = SleepController(memory)
    ctl.sleep(1)
    seq = ctl.last_seq
    memory.fail_once("restore", "runtime")
    with pytest.raises(TorporError):
        ctl.wake()
    kinds = _after(ctl, seq)
    mapped = kinds.count("tag_restored")
    assert kinds == ["wake_requested", *["tag_restored"] * mapped, *["tag_rolled_back"] * mapped, "wake_failed"]
    assert ctl.state is State.ASLEEP_L1


def test_discard_failed_before_any_change_is_a_refusal() -> None:
    """discard_failed with nothing changed records a refusal (refused) and raises the error."""
    ctl = SleepController(FakeMemory(SIZES))
    seq = ctl.last_seq
    error = TorporError("the backup of weights cannot be dropped")
    with pytest.raises(TorporError, match="cannot be dropped"):
        discard_failed(ctl._ctx, 0.0, error, changed=False, went=[])
    assert _after(ctl, seq) == ["refused"]
    assert ctl.events()[-1].data["reason"] == str(error)


def test_discard_failed_part_way_ends_partly_done() -> None:
    """discard_failed after a change records discard_completed naming what went and why, then raises."""
    ctl = SleepController(FakeMemory(SIZES))
    seq = ctl.last_seq
    error = TorporError("release of runtime failed")
    with pytest.raises(TorporError, match="release of runtime failed"):
        discard_failed(ctl._ctx, 0.0, error, changed=True, went=["kv_cache"], note=" (after dropping x)")
    (event,) = ctl.events(after=seq)
    assert event.kind is EventKind.DISCARD_COMPLETED
    assert list(event.data["tags"]) == ["kv_cache"]
    assert (event.data["error"], event.data["reason"]) == (
        "TorporError",
        "release of runtime failed (after dropping x)",
    )


def test_a_discard_whose_second_backup_drop_fails_ends_partly_done() -> None:
    """discard() of two asleep tags whose second backup cannot be dropped: tag_discarded, then discard_completed."""
    memory = FakeMemory(SIZES)
    ctl = SleepController(memory)
    ctl.sleep(1)
    seq = ctl.last_seq
    memory.fail_once("drop_backup", "runtime")
    with pytest.raises(TorporError):
        ctl.discard(["weights", "runtime"])
    assert _after(ctl, seq) == ["tag_discarded", "discard_completed"]
    assert list(ctl.events()[-1].data["tags"]) == ["weights"]


class ReleasedAnyway(FakeMemory):
    """A release of ``tag`` that fails and leaves the tag released all the same (its undo failed too)."""

    def __init__(self, tag: str, *, restore_lies: bool = False) -> None:
        super().__init__(SIZES)
        self.tag = tag
        self.restore_lies = restore_lies  # a restore that says it worked and leaves the tag released
        self.armed = False

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Fail once for ``tag`` after releasing it."""
        done = super().release(tags)
        if self.armed and self.tag in tags:
            self.armed = False
            raise MemoryOperationFailed("release", self.tag, "unmap failed; mapping it back failed too")
        return done

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Restore; with ``restore_lies``, ``tag`` stays released."""
        done = super().restore(tags)
        if self.restore_lies and self.tag in tags:
            self._tags[self.tag].resident = False
        return done


def test_a_tag_whose_failed_release_left_it_released_is_recorded_and_restored() -> None:
    """abort_sleep: the memory says the failed tag is released, so tag_released is recorded and the rollback restores it."""
    memory = ReleasedAnyway("runtime")
    ctl = SleepController(memory)
    content = memory.content("runtime")
    seq = ctl.last_seq
    memory.armed = True
    with pytest.raises(MemoryOperationFailed, match="mapping it back failed too"):
        ctl.sleep(1)
    events = ctl.events(after=seq)
    assert [e.data["tag"] for e in events if e.kind is EventKind.TAG_RELEASED][-1] == "runtime"
    assert "runtime" in [e.data["tag"] for e in events if e.kind is EventKind.TAG_RESTORED]
    assert events[-1].kind is EventKind.SLEEP_ABORTED
    assert ctl.state is State.AWAKE
    assert all(u.resident for u in memory.usage().values())
    assert memory.content("runtime") == content


def test_a_sleep_rollback_that_leaves_a_tag_released_refuses_with_not_recovered() -> None:
    """abort_sleep never records the engine awake while the memory says a tag is not resident: NotRecovered until recover()."""
    memory = ReleasedAnyway("runtime", restore_lies=True)
    ctl = SleepController(memory)
    memory.armed = True
    with pytest.raises(MemoryOperationFailed, match="recover"):
        ctl.sleep(1)
    assert ctl.state is State.SUSPENDING
    assert EventKind.SLEEP_ABORTED not in {e.kind for e in ctl.events()}
    with pytest.raises(NotRecovered, match="not resident"):
        ctl.wake()
    ctl.recover()
    assert ctl.state is State.PARTIALLY_AWAKE
    assert ctl.projection.asleep_tags() == ["runtime"]
    memory.restore_lies = False
    ctl.wake()
    assert ctl.state is State.AWAKE


def test_a_wake_rollback_whose_release_failed_but_released_records_it_rolled_back() -> None:
    """fail_wake: a release that raised but left the tag released is recorded (tag_rolled_back), so the next wake restores it."""
    memory = ReleasedAnyway("runtime")
    ctl = SleepController(memory)
    content = memory.content("runtime")
    ctl.sleep(1)
    memory.fail_once("restore", "weights")  # runtime is restored before weights (sorted), then rolled back
    memory.armed = True
    seq = ctl.last_seq
    with pytest.raises(TorporError):
        ctl.wake()
    rolled = [e.data["tag"] for e in ctl.events(after=seq) if e.kind is EventKind.TAG_ROLLED_BACK]
    assert "runtime" in rolled
    assert ctl.state is State.ASLEEP_L1
    assert "runtime" in ctl.projection.asleep_tags()
    ctl.wake()
    assert ctl.state is State.AWAKE
    assert memory.content("runtime") == content
