"""Groups in one process (LocalGroup, threads, FakeMemory): votes, rollbacks, the recorded outcome and the fleet view."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from torpor.commands.status import render
from torpor.errors import CommandInFlight, GroupFailed
from torpor.hooks import fleet
from torpor.statemachine import EventKind, SleepController, State, replay
from torpor.statemachine.machine.group import DEFAULT_TIMEOUT, UNHEARD, VOTE_BYTES, Vote, as_agreement, decide
from torpor.statemachine.machine.localgroup import LocalGroup
from torpor.testing import FakeMemory

TAGS = {"weights": 100, "kv_cache": 50, "cudagraph": 10, "runtime": 5}


def _ranks(
    n: int, tmp_path: Path | None = None, timeout: float = 10.0
) -> tuple[list[SleepController], list[FakeMemory]]:
    members = LocalGroup.make(n, name="tp")
    mems = [FakeMemory(TAGS) for _ in range(n)]
    log = None if tmp_path is None else str(tmp_path / "logs") + "/"
    ctls = [
        SleepController(m, log=log, engine="e", rank=r, fsync=False, group=g, group_timeout=timeout)
        for r, (m, g) in enumerate(zip(mems, members, strict=True))
    ]
    return ctls, mems


def _all(ctls: list[SleepController], command: Callable[[SleepController], Any]) -> list[Any]:
    """Run ``command`` on every rank at once (one thread each); each rank's result or exception."""
    out: list[Any] = [None] * len(ctls)

    def run(rank: int) -> None:
        try:
            out[rank] = command(ctls[rank])
        except Exception as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(ctls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_without_a_group_nothing_changes() -> None:
    """A controller without a group records no group event and its projection has no group."""
    ctl = SleepController(FakeMemory(TAGS))
    ctl.sleep(1)
    ctl.wake()
    assert ctl.group is None
    assert ctl.projection.group is None
    assert not [e for e in ctl.events() if e.kind is EventKind.GROUP_AGREED]


def test_vote_round_trips_and_a_long_reason_is_cut_to_fit() -> None:
    """A vote decodes to itself; a huge reason is cut so the encoded vote fits VOTE_BYTES."""
    vote = Vote(3, 7, "wake", False, "x" * 10_000)
    raw = vote.encode()
    assert len(raw) <= VOTE_BYTES
    back = Vote.decode(raw + b"\0\0")
    assert (back.rank, back.round, back.command, back.ok) == (3, 7, "wake", False)
    assert back.reason.endswith("...")


def test_decide_names_silent_failed_and_mismatched_ranks() -> None:
    """decide(): a missing vote, a no vote and a vote on another command each name their rank; unheard ranks do not."""
    votes: list[bytes | None] = [
        Vote(0, 5, "sleep", True).encode(),
        None,
        Vote(2, 5, "sleep", False, "out of memory").encode(),
        Vote(3, 4, "wake", True).encode(),
        b"",
        Vote(5, 5, "sleep", True).encode(),
    ]
    failed = decide(votes, 2.0)
    assert sorted(failed) == [1, 2, 3]
    assert "no vote within 2 s" in failed[1]
    assert failed[2] == "out of memory"
    assert "ran wake as group command #4" in failed[3]


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_failed_sleep_rolls_every_rank_back_with_data_intact(failing: int) -> None:
    """One rank's backup fails: every rank raises GroupFailed naming it, stays awake, and keeps every tag's content."""
    ctls, mems = _ranks(3)
    before = [{t: m.content(t) for t in TAGS} for m in mems]
    mems[failing].fail_once("backup")
    out = _all(ctls, lambda c: c.sleep(1))
    for rank, res in enumerate(out):
        assert isinstance(res, GroupFailed), res
        assert list(res.ranks) == [failing]
        assert res.command == "sleep"
        assert ctls[rank].state is State.AWAKE
        assert {t: mems[rank].content(t) for t in TAGS} == before[rank]  # kv_cache too: nothing was discarded
    assert all(isinstance(r, type(ctls[0].projection)) for r in _all(ctls, lambda c: c.sleep(1)))  # the retry
    assert {c.state for c in ctls} == {State.ASLEEP_L1}


def test_a_failed_wake_leaves_every_rank_asleep_with_its_backups() -> None:
    """One rank's restore fails: every rank is asleep again with its host backups, and the retry restores every byte."""
    ctls, mems = _ranks(2)
    weights = [m.content("weights") for m in mems]
    _all(ctls, lambda c: c.sleep(1))
    mems[1].fail_once("restore", "weights")
    out = _all(ctls, lambda c: c.wake())
    assert all(isinstance(r, GroupFailed) and list(r.ranks) == [1] for r in out), out
    assert all(c.state is State.ASLEEP_L1 and c.projection.residency["weights"].host == 100 for c in ctls)
    _all(ctls, lambda c: c.wake())
    assert [c.state for c in ctls] == [State.AWAKE] * 2
    assert [m.content("weights") for m in mems] == weights


def test_a_failed_discard_maps_the_tag_back_on_every_rank() -> None:
    """One rank's release of kv_cache fails: every rank is awake again with kv_cache mapped; the retry discards it everywhere."""
    ctls, mems = _ranks(2)
    mems[0].fail_once("release", "kv_cache")
    out = _all(ctls, lambda c: c.discard(["kv_cache"]))
    assert all(isinstance(r, GroupFailed) and list(r.ranks) == [0] for r in out), out
    assert [c.state for c in ctls] == [State.AWAKE] * 2
    assert all(m.content("kv_cache") is not None for m in mems)
    _all(ctls, lambda c: c.discard(["kv_cache"]))
    assert [c.state for c in ctls] == [State.PARTIALLY_AWAKE] * 2


def test_a_refusal_on_one_rank_rolls_the_others_back() -> None:
    """A rank that refuses the command (already asleep) votes no: the ranks that slept roll back to awake."""
    ctls, _ = _ranks(2)
    member, ctls[1].group = ctls[1].group, None
    ctls[1].sleep(1)  # alone: rank 1 is asleep before the group's command
    ctls[1].group = member
    out = _all(ctls, lambda c: c.sleep(1))
    assert all(isinstance(r, GroupFailed) and list(r.ranks) == [1] for r in out), out
    assert "InvalidTransition" in out[0].ranks[1]
    assert ctls[0].state is State.AWAKE


def test_a_silent_rank_is_named_after_the_timeout() -> None:
    """A rank that never votes fails the command on the others once the timeout passes; they stay as they were."""
    ctls, _ = _ranks(2, timeout=0.2)
    with pytest.raises(GroupFailed) as info:
        ctls[0].sleep(1)
    assert list(info.value.ranks) == [1]
    assert "no vote within 0.2 s" in info.value.ranks[1]
    assert ctls[0].state is State.AWAKE


def test_a_second_collective_command_on_the_same_rank_is_refused_locally() -> None:
    """While a collective command holds a rank, another one there is refused (CommandInFlight) without voting."""
    entered, release = threading.Event(), threading.Event()
    seen: list[BaseException] = []

    class Blocking(FakeMemory):
        def backup(self, tags: Any) -> Any:
            entered.set()
            release.wait(10)
            return super().backup(tags)

    ctl = SleepController(Blocking(TAGS), group=LocalGroup.make(1)[0])
    worker = threading.Thread(target=lambda: ctl.sleep(1))
    worker.start()
    entered.wait(10)
    try:
        ctl.wake()
    except CommandInFlight as exc:
        seen.append(exc)
    release.set()
    worker.join(10)
    assert seen
    assert "collective" in str(seen[0])
    assert ctl.state is State.ASLEEP_L1


def test_the_outcome_is_logged_and_replay_agrees(tmp_path: Path) -> None:
    """Each rank's log records group_agreed (group, round, result, failed ranks); replay gives the live projection's group."""
    ctls, mems = _ranks(2, tmp_path)
    _all(ctls, lambda c: c.sleep(1))
    mems[1].fail_once("restore")
    _all(ctls, lambda c: c.wake())
    for c in ctls:
        agreed = [e for e in c.events() if e.kind is EventKind.GROUP_AGREED]
        assert [(e.data["command"], e.data["round"], e.data["result"]) for e in agreed] == [
            ("sleep", 1, "commit"),
            ("wake", 2, "rollback"),
        ]
        assert list(agreed[-1].data["failed"]) == ["1"]
        assert c.projection.group is not None
        assert c.projection.group["result"] == "rollback"
        assert replay(tmp_path / "logs" / f"e.rank{c.rank}.jsonl").group == c.projection.group
        assert type(c.projection).from_dict(c.projection.to_dict()).group == c.projection.group


def test_fleet_shows_the_group_consistent_or_split(tmp_path: Path) -> None:
    """fleet() and torpor status show the group as one engine: consistent after group commands, split naming the rank that moved alone."""
    ctls, mems = _ranks(3, tmp_path)
    _all(ctls, lambda c: c.sleep(1))
    mems[2].fail_once("restore")
    _all(ctls, lambda c: c.wake())
    view = fleet(tmp_path / "logs").engine("e")
    assert view.group is not None
    assert view.group.consistent
    assert (view.group.command, view.group.round, view.group.result) == ("wake", 2, "rollback")
    assert list(view.group.failed) == ["2"]
    assert "group tp: wake #2 rollback (failed: rank 2); consistent" in render(fleet(tmp_path / "logs"))
    ctls[1].group = None  # rank 1 leaves the group and wakes alone: the group is split
    ctls[1].wake()
    view = fleet(tmp_path / "logs").engine("e")
    assert view.group is not None
    assert not view.group.consistent
    assert view.group.differ == (1,)
    assert "split: rank 1 differ" in render(fleet(tmp_path / "logs"))
    assert view.to_dict()["group"]["differ"] == [1]


def test_as_agreement_takes_agreements_and_refuses_other_objects() -> None:
    """as_agreement passes an Agreement through and refuses an object that is neither that nor a torch group."""
    member = LocalGroup.make(2)[0]
    assert as_agreement(member) is member
    with pytest.raises(TypeError, match="Agreement"):
        as_agreement(object())
    with pytest.raises(ValueError, match="group timeout"):
        SleepController(FakeMemory(TAGS), group=member, group_timeout=0)


def test_the_group_module_imports_no_torch() -> None:
    """torpor.statemachine (the group protocol included) imports without torch."""
    code = "import sys, torpor.statemachine.machine.group, torpor.statemachine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_rank_hung_in_its_prepare_reads_the_outcome_that_names_it() -> None:
    """A rank whose prepare outlasts the timeout votes in the round it started and reads the rollback naming it."""
    entered, release = threading.Event(), threading.Event()

    class Slow(FakeMemory):
        def backup(self, tags: Any) -> Any:
            entered.set()
            release.wait(10)
            return super().backup(tags)

    members = LocalGroup.make(2, name="tp")
    ctls = [SleepController(FakeMemory(TAGS), group=members[0], group_timeout=0.2)]
    ctls.append(SleepController(Slow(TAGS), rank=1, group=members[1], group_timeout=0.2))
    seen: list[BaseException] = []
    late = threading.Thread(target=lambda: seen.extend(_all([ctls[1]], lambda c: c.sleep(1))))
    late.start()
    entered.wait(10)
    with pytest.raises(GroupFailed) as info:
        ctls[0].sleep(1)
    release.set()
    late.join(10)
    assert list(info.value.ranks) == [1]
    assert isinstance(seen[0], GroupFailed) and list(seen[0].ranks) == [1]
    assert seen[0].round == info.value.round
    assert [c.state for c in ctls] == [State.AWAKE] * 2


def test_a_command_started_after_the_others_gave_up_is_a_new_round() -> None:
    """LocalGroup: a rank that starts after a round was decided runs the next round, never reads the old one."""
    ctls, _ = _ranks(2, timeout=0.2)
    with pytest.raises(GroupFailed) as first:
        ctls[0].sleep(1)
    with pytest.raises(GroupFailed) as second:
        ctls[1].sleep(1)
    assert list(first.value.ranks) == [1]
    assert list(second.value.ranks) == [0]  # a round of its own: rank 0 was not in it
    assert second.value.round == first.value.round + 1
    assert [c.state for c in ctls] == [State.AWAKE] * 2


@pytest.mark.parametrize("alone", [0, 1])
def test_one_uneven_command_does_not_break_the_group(alone: int) -> None:
    """One rank alone calls wake() (refused, fails after the timeout); the next joint sleep and wake succeed at once."""
    ctls, mems = _ranks(2, timeout=0.3)
    with pytest.raises(GroupFailed):
        ctls[alone].wake()
    for command in (lambda c: c.sleep(1), lambda c: c.wake()):
        start = time.monotonic()
        out = _all(ctls, command)
        assert not [r for r in out if isinstance(r, Exception)], out
        assert time.monotonic() - start < 0.3
    assert [c.state for c in ctls] == [State.AWAKE] * 2
    assert all(m.content("weights") is not None for m in mems)


def test_an_uneven_command_overlapping_the_next_one_fails_that_round_only() -> None:
    """Rank 1 starts a sleep while rank 0's lone wake still waits: that round fails on both, the next commands succeed."""
    ctls, _ = _ranks(2, timeout=5.0)
    lone: list[Any] = []
    waiting = threading.Thread(target=lambda: lone.extend(_all([ctls[0]], lambda c: c.wake())))
    waiting.start()
    time.sleep(0.1)  # rank 0's wake is in its round, waiting for rank 1
    with pytest.raises(GroupFailed) as info:
        ctls[1].sleep(1)
    waiting.join(10)
    assert isinstance(lone[0], GroupFailed) and lone[0].round == info.value.round
    assert "ran sleep" in info.value.ranks[1]
    for command in (lambda c: c.sleep(1), lambda c: c.wake()):
        out = _all(ctls, command)
        assert not [r for r in out if isinstance(r, Exception)], out
    assert [c.state for c in ctls] == [State.AWAKE] * 2


def test_a_reopened_controller_gets_back_in_step() -> None:
    """One rank closes its controller and opens a new one on the same group: the next joint sleep and wake succeed."""
    ctls, mems = _ranks(2, timeout=0.3)
    _all(ctls, lambda c: c.sleep(1))
    _all(ctls, lambda c: c.wake())
    member = ctls[1].group.agreement if ctls[1].group else None
    ctls[1].close()
    ctls[1] = SleepController(mems[1], engine="e", rank=1, group=member, group_timeout=0.3)
    for command in (lambda c: c.sleep(1), lambda c: c.wake()):
        out = _all(ctls, command)
        assert not [r for r in out if isinstance(r, Exception)], out
    assert [c.state for c in ctls] == [State.AWAKE] * 2


def test_a_rank_that_cannot_start_its_round_fails_without_running_the_command() -> None:
    """An agreement whose begin() raises fails the command on that rank (GroupFailed naming it); nothing changes."""

    class Unreachable(LocalGroup):
        def begin(self, timeout: float) -> int:
            msg = "connection reset"
            raise RuntimeError(msg)

    shared = LocalGroup.make(2, name="tp")[0]._shared
    mem = FakeMemory(TAGS)
    ctl = SleepController(mem, group=Unreachable(shared, 0), group_timeout=0.2)
    with pytest.raises(GroupFailed) as info:
        ctl.sleep(1)
    assert list(info.value.ranks) == [0]
    assert "connection reset" in info.value.ranks[0]
    assert ctl.state is State.AWAKE
    assert mem.content("weights") is not None
    assert [e.data["result"] for e in ctl.events() if e.kind is EventKind.GROUP_AGREED] == ["rollback"]


def test_decide_never_commits_on_a_vote_it_did_not_hear() -> None:
    """decide(): a list with an unheard rank and no failure is a failure naming that rank, never a commit."""
    failed = decide([Vote(0, 3, "sleep", True).encode(), UNHEARD], 1.0)
    assert list(failed) == [1]
    assert "not known" in failed[1]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 0.0, 10.0**9])
def test_invalid_group_timeouts_are_refused_at_configuration(bad: float) -> None:
    """A group timeout that is not a finite number of seconds in range is a ValueError when the controller is built."""
    with pytest.raises(ValueError, match="group timeout"):
        SleepController(FakeMemory(TAGS), group=LocalGroup.make(1)[0], group_timeout=bad)


def test_a_timeout_from_the_environment_is_checked_and_named() -> None:
    """parse_timeout() names the variable it read when its value is not a usable number of seconds."""
    from torpor.statemachine.machine.group import parse_timeout

    assert parse_timeout("2.5", "TORPOR_GROUP_TIMEOUT") == 2.5
    assert parse_timeout(None, "TORPOR_GROUP_TIMEOUT") == DEFAULT_TIMEOUT
    for bad in ("nan", "abc", "-3", "inf"):
        with pytest.raises(ValueError, match="TORPOR_GROUP_TIMEOUT"):
            parse_timeout(bad, "TORPOR_GROUP_TIMEOUT")


def test_fleet_group_view_with_ranks_that_never_joined() -> None:
    """group_view(): ranks without a group outcome differ from those with one; no crash when they are the majority."""
    from torpor.readmodel.ranklogs import RankView, group_view

    g = {"group": "tp", "command": "sleep", "round": 1, "result": "commit", "failed": {}}
    ranks = [
        RankView("e", 0, None, "asleep_l1", group=g),
        RankView("e", 1, None, "awake"),
        RankView("e", 2, None, "awake"),
    ]
    view = group_view(ranks)
    assert view is not None
    assert (view.round, view.consistent, view.differ) == (1, False, (1, 2))
