"""Tests for torpor.statemachine.projection.view: the fold, snapshots and replay."""

from __future__ import annotations

from pathlib import Path

from support import raw_event

from torpor import SleepController, State, replay
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.projection.view import Projection, follow_on, project
from torpor.testing import FakeMemory

SIZES = {"weights": 100, "kv_cache": 200, "cudagraph": 10}


def test_replay_of_events_equals_replay_of_file(tmp_path: Path) -> None:
    """Replaying the controller's events in memory and from its log file give the same projection."""
    ctl = SleepController(FakeMemory(SIZES), log=tmp_path / "e.jsonl")
    ctl.sleep(1)
    ctl.wake(["weights"])
    assert replay(ctl.events()).to_dict() == replay(tmp_path / "e.jsonl").to_dict() == ctl.projection.to_dict()
    assert replay(tmp_path / "e.jsonl").state is State.PARTIALLY_AWAKE


def test_residency_per_tag_after_level1() -> None:
    """After a level-1 sleep weights are on the host and kv_cache is discarded."""
    ctl = SleepController(FakeMemory(SIZES))
    ctl.sleep(1)
    res = replay(ctl.events()).residency
    assert (res["weights"].resident, res["weights"].host, res["weights"].discarded) == (0, 100, 0)
    assert (res["kv_cache"].resident, res["kv_cache"].host, res["kv_cache"].discarded) == (0, 0, 200)


def test_snapshot_round_trip() -> None:
    """to_dict then from_dict gives an equal projection."""
    ctl = SleepController(FakeMemory(SIZES))
    ctl.sleep(2)
    proj = ctl.projection
    assert Projection.from_dict(proj.to_dict()).to_dict() == proj.to_dict()


def test_snapshot_event_replaces_history() -> None:
    """A snapshot event sets the projection to its content, whatever came before."""
    ctl = SleepController(FakeMemory(SIZES))
    ctl.sleep(1)
    snap = raw_event(EventKind.SNAPSHOT, 1, "e", 0, {"projection": ctl.projection.to_dict()})
    assert project([snap]).state is State.ASLEEP_L1
    assert project([snap]).asleep_tags() == ["cudagraph", "kv_cache", "weights"]


def test_interrupted_log_names_the_step() -> None:
    """A projection that ends in suspending is interrupted and names the last step."""
    ctl = SleepController(FakeMemory(SIZES))
    ctl.sleep(1)
    events = [e for e in ctl.events() if e.kind is not EventKind.SLEEP_COMPLETED]
    proj = project(events)
    assert proj.interrupted
    assert proj.state is State.SUSPENDING
    assert "tag_released" in proj.last_step


def test_transitions_counted() -> None:
    """Each state change counts once: sleep is two (suspending, asleep), wake two more."""
    ctl = SleepController(FakeMemory(SIZES))
    ctl.sleep(1)
    ctl.wake()
    assert ctl.projection.transitions == 4


def test_every_kind_has_a_step_and_no_state_kinds_change_nothing_else() -> None:
    """Each event kind folds without error; a no-state kind changes only the last-event fields."""
    from torpor.statemachine.projection.view import _NO_STATE, _STEPS

    assert set(_STEPS) == set(EventKind)
    ctl = SleepController(FakeMemory(SIZES))
    ctl.sleep(1)
    before = ctl.projection.to_dict()
    last_event_fields = ("last_seq", "last_kind", "last_wall", "engine", "rank", "pid", "last_step")
    for kind in sorted(_NO_STATE):
        proj = Projection.from_dict(before)
        proj.apply(raw_event(kind, before["last_seq"] + 1, "x", 7, {"tag": "weights", "bytes": 1, "state": "awake"}))
        after = proj.to_dict()
        assert (after["last_kind"], after["engine"], after["rank"]) == (kind.value, "x", 7)
        derived = ("state", "closed") if kind is EventKind.CLOSED else ()  # a closed log reads closed
        assert {k: v for k, v in after.items() if k not in last_event_fields + derived} == {
            k: v for k, v in before.items() if k not in last_event_fields + derived
        }
        if derived:
            assert (after["state"], after["machine_state"], after["closed"]) == ("closed", before["state"], True)


def test_residency_stays_exact_past_the_shared_usage_bound() -> None:
    """Replaying more distinct byte counts than the shared-usage bound still gives each tag its own figures."""
    events = [raw_event(EventKind.OPENED, 1, "e", 0, {"usage": {}})]
    for i in range(5000):
        usage = {"weights": 1000 + i, "kv_cache": 2 * i}
        events.append(raw_event(EventKind.USAGE_OBSERVED, len(events) + 1, "e", 0, {"usage": usage}))
    proj = project(events)
    assert (proj.residency["weights"].resident, proj.residency["kv_cache"].resident) == (5999, 9998)
    assert proj.residency["weights"] != proj.residency["kv_cache"]


def test_follow_on_starts_afresh_when_the_log_starts_anew() -> None:
    """A followed log whose event #1 comes again (not a snapshot) folds into a fresh projection; the next event continues it."""
    proj = Projection()
    for seq in (1, 2):
        proj = follow_on(proj, raw_event(EventKind.USAGE_OBSERVED, seq, "e", 0, {"usage": {"weights": 5}}))
    assert proj.last_seq == 2
    again = follow_on(proj, raw_event(EventKind.USAGE_OBSERVED, 1, "e", 0, {"usage": {"weights": 7}}))
    assert again is not proj and again.last_seq == 1
    assert follow_on(again, raw_event(EventKind.USAGE_OBSERVED, 2, "e", 0, {"usage": {}})) is again


def test_a_closed_log_reads_closed_and_keeps_the_machine_state() -> None:
    """After close(): shown_state and to_dict()['state'] say closed, machine_state the state it closed in."""
    ctl = SleepController(FakeMemory(SIZES))
    ctl.sleep(1)
    assert not ctl.projection.closed and ctl.projection.to_dict()["state"] == "asleep_l1"
    ctl.close()
    proj = replay(ctl.events())
    assert proj.closed and proj.shown_state == "closed" and proj.state is State.ASLEEP_L1
    d = proj.to_dict()
    assert (d["state"], d["machine_state"], d["closed"]) == ("closed", "asleep_l1", True)


def test_a_closed_projection_round_trips_through_its_dict_as_a_snapshot_does() -> None:
    """from_dict(to_dict()) of a closed projection keeps the machine state (snapshots carry to_dict)."""
    ctl = SleepController(FakeMemory(SIZES))
    ctl.sleep(2)
    ctl.close()
    back = Projection.from_dict(ctl.projection.to_dict())
    assert back.state is State.ASLEEP_L2 and back.closed and back.to_dict() == ctl.projection.to_dict()


def test_an_event_after_closed_opens_the_log_again() -> None:
    """A controller reopened on a closed log appends 'opened': the log no longer reads closed."""
    proj = Projection()
    for seq, kind in enumerate([EventKind.OPENED, EventKind.CLOSED, EventKind.OPENED], start=1):
        proj.apply(raw_event(kind, seq, "e", 0, {"usage": {}} if kind is EventKind.OPENED else {}))
        assert proj.closed is (kind is EventKind.CLOSED)


def test_allocation_counts_come_from_the_events_as_the_memory_reports_them() -> None:
    """opened, sleep_requested and usage_observed carry allocations per tag; the projection reports them."""
    mem = FakeMemory(SIZES)
    ctl = SleepController(mem)
    want = {t: u.allocations for t, u in mem.usage().items()}
    assert want == dict.fromkeys(SIZES, 1)
    assert {t: u.allocations for t, u in ctl.projection.residency.items()} == want
    ctl.sleep(1)
    assert {t: u.allocations for t, u in replay(ctl.events()).residency.items()} == want
    assert ctl.projection.to_dict()["residency"]["weights"]["allocations"] == 1
    kinds = {e.kind for e in ctl.events() if "allocations" in e.data}
    assert kinds == {EventKind.OPENED, EventKind.SLEEP_REQUESTED}
    ctl.observe()
    assert ctl.events()[-1].data["allocations"] == want


def test_a_log_written_before_allocation_counts_reads_zero() -> None:
    """Events without the allocations field (older logs) fold as before: counts 0, bytes as recorded."""
    proj = project([raw_event(EventKind.OPENED, 1, "e", 0, {"usage": {"weights": 64}})])
    assert proj.residency["weights"].allocations == 0 and proj.residency["weights"].resident == 64
