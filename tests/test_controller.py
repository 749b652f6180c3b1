"""Tests for torpor.statemachine.machine.controller: guarded commands, two-phase sleep, rollback, subscribers."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from support import hold_call

from torpor import SleepController, State, replay
from torpor.errors import (
    CommandInFlight,
    InvalidLevel,
    InvalidTransition,
    MemoryOperationFailed,
    NoTagsNamed,
    NotRecovered,
    PoolBusy,
    TorporError,
    UnknownTag,
)
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import latest_snapshot
from torpor.testing import FakeMemory, capture_events

SIZES = {"weights": 2**30, "kv_cache": 2**31, "cudagraph": 2**26, "runtime": 2**20}


@pytest.fixture
def memory() -> FakeMemory:
    return FakeMemory(SIZES)


@pytest.fixture
def ctl(memory: FakeMemory, tmp_path: Path) -> SleepController:
    return SleepController(memory, log=tmp_path / "events.jsonl", engine="e", rank=0)


def _contents(memory: FakeMemory) -> dict[str, int | None]:
    return {tag: memory.content(tag) for tag in SIZES}


def test_level1_full_cycle_restores_everything(ctl: SleepController, memory: FakeMemory) -> None:
    """Level-1 sleep then full wake keeps every offloaded tag's content; kv_cache is fresh."""
    before = _contents(memory)
    ctl.sleep(1)
    assert ctl.state is State.ASLEEP_L1
    res = ctl.projection.residency
    assert res["weights"].host == SIZES["weights"] and res["kv_cache"].discarded == SIZES["kv_cache"]
    ctl.wake()
    assert ctl.state is State.AWAKE
    after = _contents(memory)
    assert {t: after[t] == before[t] for t in SIZES} == {
        "weights": True,
        "cudagraph": True,
        "runtime": True,
        "kv_cache": False,
    }


def test_rl_sequence_passes_partially_awake(ctl: SleepController) -> None:
    """wake(weights) leaves kv_cache asleep (partially_awake); wake(kv_cache) ends awake."""
    ctl.sleep(1)
    ctl.wake(["weights"])
    assert ctl.state is State.PARTIALLY_AWAKE
    assert ctl.projection.asleep_tags() == ["kv_cache"]
    assert ctl.projection.residency["cudagraph"].resident == SIZES["cudagraph"]
    ctl.wake(["kv_cache"])
    assert ctl.state is State.AWAKE


def test_level2_discards_weights(ctl: SleepController, memory: FakeMemory) -> None:
    """Level 2 discards weights (a new content on wake) and keeps cudagraph."""
    before = _contents(memory)
    ctl.sleep(2)
    assert ctl.projection.residency["weights"].discarded == SIZES["weights"]
    ctl.wake()
    assert memory.content("weights") != before["weights"]
    assert memory.content("cudagraph") == before["cudagraph"]


def test_invalid_wake_names_state_event_and_allowed(ctl: SleepController) -> None:
    """Waking while awake raises InvalidTransition naming the state, the event number and the allowed states."""
    with pytest.raises(InvalidTransition) as info:
        ctl.wake()
    msg = str(info.value)
    assert "cannot wake from 'awake' (event #1" in msg
    assert "allowed from: asleep_l1, asleep_l2, partially_awake" in msg
    assert ctl.projection.refusals == 1
    assert ctl.events()[-1].kind is EventKind.REFUSED


def test_refused_commands_change_nothing(ctl: SleepController) -> None:
    """A refused command leaves state and residency as they were, and is logged."""
    ctl.sleep(1)
    before = ctl.projection.to_dict()
    for bad in (lambda: ctl.sleep(1), lambda: ctl.sleep(3), lambda: ctl.wake(["nonsense"])):
        with pytest.raises((InvalidTransition, InvalidLevel, UnknownTag)):
            bad()
    after = ctl.projection.to_dict()
    assert after["refusals"] == before["refusals"] + 3
    for key in ("state", "residency", "since"):
        assert after[key] == before[key]


def test_backup_failure_aborts_sleep(ctl: SleepController, memory: FakeMemory) -> None:
    """A failure while backing up aborts the sleep: still awake, nothing released, an event says why."""
    before = _contents(memory)
    memory.fail_once("backup", "runtime")
    with pytest.raises(MemoryOperationFailed):
        ctl.sleep(1)
    assert ctl.state is State.AWAKE
    assert _contents(memory) == before
    aborted = [e for e in ctl.events() if e.kind is EventKind.SLEEP_ABORTED]
    assert "backup failed" in aborted[-1].data["reason"]
    assert not any(op == "release" for op, _ in memory.calls)


def test_release_failure_rolls_back(ctl: SleepController, memory: FakeMemory) -> None:
    """A failure while releasing maps back what was released and stays awake with offloaded content intact."""
    before = _contents(memory)
    memory.fail_once("release", "weights")
    with pytest.raises(MemoryOperationFailed):
        ctl.sleep(1)
    assert ctl.state is State.AWAKE
    after = _contents(memory)
    assert all(after[t] == before[t] for t in ("cudagraph", "runtime", "weights"))
    ctl.sleep(1)
    ctl.wake()
    assert _contents(memory)["weights"] == before["weights"]


def test_wake_failure_rolls_back_and_stays_asleep(ctl: SleepController, memory: FakeMemory) -> None:
    """A failure during wake unmaps what was mapped, stays asleep, and the next wake restores exactly."""
    before = _contents(memory)
    ctl.sleep(1)
    memory.fail_once("restore", "weights")
    with pytest.raises(MemoryOperationFailed):
        ctl.wake()
    assert ctl.state is State.ASLEEP_L1
    assert all(memory.content(t) is None for t in SIZES)
    ctl.wake()
    assert memory.content("weights") == before["weights"]
    assert replay(ctl.log.path).to_dict() == ctl.projection.to_dict()  # type: ignore[union-attr]


def test_command_in_flight_is_refused(ctl: SleepController, memory: FakeMemory) -> None:
    """A command arriving while another is in flight is refused at once, not queued."""
    entered, release = hold_call(memory, "backup", wait=5)
    worker = threading.Thread(target=ctl.sleep, args=(1,))
    worker.start()
    assert entered.wait(5)
    with pytest.raises(CommandInFlight, match="sleep"):
        ctl.wake()
    release.set()
    worker.join(5)
    assert ctl.state is State.ASLEEP_L1


def test_wait_for_from_another_thread(ctl: SleepController) -> None:
    """wait_for returns True once another thread reaches the state, False on timeout."""
    assert not ctl.wait_for(State.ASLEEP_L1, timeout=0.05)
    threading.Timer(0.05, ctl.sleep, args=(1,)).start()
    assert ctl.wait_for(State.ASLEEP_L1, timeout=5)


def test_wait_for_async(ctl: SleepController) -> None:
    """The asyncio variant resolves when a thread puts the controller to sleep."""

    async def scenario() -> bool:
        threading.Timer(0.05, ctl.sleep, args=(2,)).start()
        return await ctl.wait_for_async("asleep_l2", timeout=5)

    assert asyncio.run(scenario())


def test_raising_subscriber_does_not_break_controller(ctl: SleepController, caplog: pytest.LogCaptureFixture) -> None:
    """A subscriber that raises is logged and the command still completes."""

    def boom(event: object) -> None:
        raise RuntimeError("subscriber bug")

    ctl.subscribe(boom)
    ctl.sleep(1)
    assert ctl.state is State.ASLEEP_L1
    assert "subscriber" in caplog.text


def test_subscribe_filters_kinds(ctl: SleepController) -> None:
    """A subscriber given kinds sees only those kinds."""
    with capture_events(ctl, kinds=[EventKind.TAG_RELEASED]) as seen:
        ctl.sleep(1)
    assert {e.kind for e in seen} == {EventKind.TAG_RELEASED}
    assert sorted(e.data["tag"] for e in seen) == sorted(SIZES)


def test_pool_release_refused_while_referenced(ctl: SleepController, memory: FakeMemory) -> None:
    """Releasing the graph pool while a graph lives raises PoolBusy naming the graph's site."""
    with ctl.capture("CudaGraphManager.capture batch=8"):
        pass
    memory.other_references = 1
    with pytest.raises(PoolBusy) as info:
        ctl.release_cudagraph_pool()
    assert info.value.holders == ("graph captured at CudaGraphManager.capture batch=8", "1 other reference(s)")
    memory.drop_graph("CudaGraphManager.capture batch=8")
    memory.other_references = 0
    assert ctl.release_cudagraph_pool() > 0
    assert ctl.projection.pool is None


def test_pool_release_refused_while_asleep(ctl: SleepController) -> None:
    """Releasing the graph pool while asleep raises PoolBusy: freeing would unmap a second time."""
    with ctl.capture("site"):
        pass
    ctl.sleep(1)
    with pytest.raises(PoolBusy, match="asleep"):
        ctl.release_cudagraph_pool()


def test_capture_refused_while_asleep(ctl: SleepController) -> None:
    """Capturing into the graph pool is refused unless awake."""
    ctl.sleep(1)
    with pytest.raises(InvalidTransition, match="cannot capture"), ctl.capture("site"):
        pass


def test_discard_while_asleep_drops_backup(ctl: SleepController, memory: FakeMemory) -> None:
    """discard(weights) while asleep drops its backup: the next wake maps fresh memory."""
    before = memory.content("weights")
    ctl.sleep(1)
    ctl.discard(["weights"])
    assert ctl.projection.residency["weights"].discarded == SIZES["weights"]
    ctl.wake()
    assert memory.content("weights") != before


def test_discard_failing_after_a_first_backup_went_ends_partly_done(ctl: SleepController, memory: FakeMemory) -> None:
    """A discard of two asleep tags whose second backup drop fails records the first as discarded and says why."""
    ctl.sleep(1)
    memory.fail_once("drop_backup", "weights")
    seq = ctl.last_seq
    with pytest.raises(MemoryOperationFailed):
        ctl.discard(["runtime", "weights"])
    kinds = [e.kind for e in ctl.events(after=seq)]
    assert kinds == [EventKind.TAG_DISCARDED, EventKind.DISCARD_COMPLETED]
    done = ctl.events(after=seq)[-1].data
    assert done["tags"] == ("runtime",) and done["error"] and "weights" in done["reason"]
    assert ctl.projection.residency["runtime"].discarded and ctl.projection.residency["weights"].host
    assert ctl.state is State.ASLEEP_L1 and replay(ctl.events()).residency == ctl.projection.residency


def test_discard_failing_first_is_a_refusal_that_changes_nothing(ctl: SleepController, memory: FakeMemory) -> None:
    """A discard whose first backup drop fails is refused: logged, nothing discarded."""
    ctl.sleep(1)
    before = ctl.projection.to_dict()
    memory.fail_once("drop_backup", "runtime")
    seq = ctl.last_seq
    with pytest.raises(MemoryOperationFailed):
        ctl.discard(["runtime", "weights"])
    assert [e.kind for e in ctl.events(after=seq)] == [EventKind.REFUSED]
    assert ctl.projection.to_dict()["residency"] == before["residency"]


def test_log_path_names_a_file_or_a_directory(memory: FakeMemory, tmp_path: Path) -> None:
    """log=: a new path with a suffix is the file; a new path without one, or ending in /, is a directory."""
    SleepController(memory, log=tmp_path / "a" / "events.jsonl", engine="e").close()
    assert (tmp_path / "a" / "events.jsonl").is_file()
    SleepController(memory, log=tmp_path / "logs", engine="e", rank=3).close()
    assert (tmp_path / "logs" / "e.rank3.jsonl").is_file()
    SleepController(memory, log=f"{tmp_path}/more.d/", engine="e").close()
    assert (tmp_path / "more.d" / "e.rank0.jsonl").is_file()
    (tmp_path / "plain").write_text("")  # an existing file without a suffix stays a file
    SleepController(memory, log=tmp_path / "plain", engine="e").close()
    assert (tmp_path / "plain").is_file()


def test_log_path_is_the_file_the_controller_writes_and_refused_without_a_log(
    memory: FakeMemory, tmp_path: Path
) -> None:
    """log_path is the event log's file (ENGINE.rankN.jsonl inside a directory); with log=None it is a TorporError naming why."""
    ctl = SleepController(memory, log=tmp_path / "logs", engine="e", rank=2)
    assert ctl.log_path == tmp_path / "logs" / "e.rank2.jsonl"
    assert ctl.log_path.is_file()
    ctl.close()
    in_memory = SleepController(memory, engine="e")
    with pytest.raises(TorporError, match=r"engine 'e' rank 0 keeps no event log \(made with log=None\)"):
        _ = in_memory.log_path
    in_memory.close()


def test_reopened_log_continues(memory: FakeMemory, tmp_path: Path) -> None:
    """A controller opened on an existing clean log continues its sequence."""
    first = SleepController(memory, log=tmp_path)
    first.sleep(1)
    first.wake()
    last = first.last_seq
    first.close()
    second = SleepController(memory, log=tmp_path)
    assert second.events()[0].seq == last + 2  # closed, then opened
    assert second.state is State.AWAKE


def test_interrupted_log_refuses_until_recovered(memory: FakeMemory, tmp_path: Path) -> None:
    """A log that ends mid-sleep makes a new controller refuse commands until recover()."""
    live, path = tmp_path / "live.jsonl", tmp_path / "events.jsonl"
    first = SleepController(memory, log=live)

    def killed(tags: object) -> None:  # the process dies here: its log is what was on disk at that moment
        shutil.copyfile(live, path)
        raise SystemExit("killed")

    memory.backup = killed  # type: ignore[assignment, method-assign]
    with pytest.raises(SystemExit):
        first.sleep(1)
    first.log.close()  # type: ignore[union-attr]
    second = SleepController(FakeMemory(SIZES), log=path)
    assert second.state is State.SUSPENDING
    with pytest.raises(NotRecovered, match="interrupted"):
        second.sleep(1)
    second.recover()
    assert second.state is State.AWAKE
    second.sleep(1)
    assert replay(path).state is State.ASLEEP_L1


def test_controller_rotation_replays(memory: FakeMemory, tmp_path: Path) -> None:
    """With a tiny rotation size the controller's projection still equals replay of the log."""
    log = EventLog(tmp_path / "events.jsonl", max_bytes=2000, fsync=False)
    ctl = SleepController(memory, log=log)
    for level in (1, 2, 1):
        ctl.sleep(level)
        ctl.wake(["weights"])
        ctl.wake()
    assert len(list(tmp_path.glob("events.jsonl.*"))) >= 2
    assert replay(tmp_path / "events.jsonl").to_dict() == ctl.projection.to_dict()


def test_unknown_tag_names_known_tags(ctl: SleepController) -> None:
    """Waking an unknown tag lists the known tags."""
    ctl.sleep(1)
    with pytest.raises(UnknownTag, match="known tags: cudagraph, kv_cache, runtime, weights"):
        ctl.wake(["wieghts"])


def test_discard_resident_kv_cache_while_awake(ctl: SleepController, memory: FakeMemory) -> None:
    """discard(kv_cache) while awake releases it without backup and leaves the engine partially_awake."""
    weights = memory.content("weights")
    ctl.discard(["kv_cache"])
    assert ctl.state is State.PARTIALLY_AWAKE
    assert memory.content("kv_cache") is None
    assert ctl.projection.residency["kv_cache"].discarded == SIZES["kv_cache"]
    ctl.wake(["kv_cache"])
    assert ctl.state is State.AWAKE
    assert memory.content("weights") == weights
    assert replay(ctl.log.path).to_dict() == ctl.projection.to_dict()  # type: ignore[union-attr]


def test_discard_resident_nondeferrable_refused(ctl: SleepController) -> None:
    """A resident tag that every wake restores (runtime) cannot be discarded; nothing changes."""
    with pytest.raises(InvalidTransition, match="only kv_cache, weights can be discarded while resident"):
        ctl.discard(["runtime"])
    assert ctl.state is State.AWAKE
    assert ctl.projection.residency["runtime"].resident == SIZES["runtime"]


def test_wake_accepts_one_tag_as_string(ctl: SleepController) -> None:
    """wake("weights") means the tag weights, not the letters w, e, i, ..."""
    ctl.sleep(1)
    ctl.wake("weights")
    assert ctl.state is State.PARTIALLY_AWAKE
    assert ctl.projection.asleep_tags() == ["kv_cache"]


def test_float_level_is_refused(ctl: SleepController) -> None:
    """sleep(1.0) is refused: the level is the integer 1 or 2."""
    with pytest.raises(InvalidLevel, match=r"1\.0"):
        ctl.sleep(1.0)  # type: ignore[arg-type]
    assert ctl.state is State.AWAKE


def test_repeated_tags_are_one(ctl: SleepController) -> None:
    """A wake naming a tag many times names it once (and its event stays small)."""
    ctl.sleep(1)
    ctl.wake(["weights"] * 10_000)
    assert ctl.events(after=ctl.last_seq - 20)[-1].data["tags"] == ("weights",)


def test_rotation_snapshot_reaches_subscribers(memory: FakeMemory, tmp_path: Path) -> None:
    """Subscribers and events() see the rotation's snapshot: sequence numbers have no gaps."""
    ctl = SleepController(memory, log=EventLog(tmp_path / "e.jsonl", max_bytes=1500, fsync=False))
    with capture_events(ctl) as seen:
        for _ in range(3):
            ctl.sleep(1)
            ctl.wake()
    seqs = [e.seq for e in seen]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert EventKind.SNAPSHOT in {e.kind for e in seen}


def test_idempotent_sleep_when_asleep_at_that_level_or_deeper_is_a_recorded_no_op(
    ctl: SleepController, tmp_path: Path
) -> None:
    """sleep(idempotent=True) while asleep at that level or deeper records command_repeated; a shallower-to-deeper one is refused."""
    ctl.sleep(2)
    seq = ctl.last_seq
    assert ctl.sleep(2, idempotent=True).state is State.ASLEEP_L2
    assert ctl.sleep(1, idempotent=True).state is State.ASLEEP_L2  # deeper already
    new = ctl.events(after=seq)
    assert [e.kind for e in new] == [EventKind.COMMAND_REPEATED] * 2
    assert new[0].data["command"] == "sleep" and new[0].data["args"] == {"level": 2}
    assert "already asleep at level 2" in new[0].data["reason"]
    with pytest.raises(InvalidTransition):
        ctl.sleep(2)  # without idempotent the controller still refuses
    ctl.wake()
    ctl.sleep(1)
    with pytest.raises(InvalidTransition):
        ctl.sleep(2, idempotent=True)  # level 2 does not hold at level 1
    assert replay(tmp_path / "events.jsonl").to_dict() == ctl.projection.to_dict()


def test_idempotent_wake_of_resident_tags_is_a_recorded_no_op(ctl: SleepController, tmp_path: Path) -> None:
    """wake(idempotent=True) that would restore nothing records command_repeated; unknown tags are still refused."""
    seq = ctl.last_seq
    assert ctl.wake(idempotent=True).state is State.AWAKE
    assert ctl.wake(["weights"], idempotent=True).state is State.AWAKE
    assert [e.kind for e in ctl.events(after=seq)] == [EventKind.COMMAND_REPEATED] * 2
    with pytest.raises(UnknownTag):
        ctl.wake(["wieghts"], idempotent=True)
    ctl.sleep(1)
    ctl.wake(["weights"])
    seq = ctl.last_seq
    assert ctl.wake(["weights"], idempotent=True).state is State.PARTIALLY_AWAKE  # weights resident already
    assert [e.kind for e in ctl.events(after=seq)] == [EventKind.COMMAND_REPEATED]
    assert ctl.wake(["kv_cache"], idempotent=True).state is State.AWAKE  # kv_cache was asleep: a real wake
    assert replay(tmp_path / "events.jsonl").to_dict() == ctl.projection.to_dict()


@pytest.mark.parametrize("empty_active", [False, True], ids=["active-file", "crash-after-rename"])
def test_opening_a_long_log_reads_only_from_the_newest_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, empty_active: bool
) -> None:
    """A controller opened on a log of many rotated segments reads none of the older ones (the newest snapshot carries the state) and agrees with a full replay."""
    path = tmp_path / "e.jsonl"
    first = SleepController(FakeMemory(SIZES), EventLog(path, fsync=False, max_bytes=2_000))
    for _ in range(30):
        first.sleep(1)
        first.wake()
    first.sleep(2)
    first.close()
    older = sorted(tmp_path.glob("e.jsonl.*"))
    assert len(older) >= 10
    if empty_active:  # a crash between a rotation's two renames: the newest file is a segment, no active file
        newest = tmp_path / f"e.jsonl.{latest_snapshot(path):012d}"
        path.rename(newest)
    opened: list[str] = []
    real_open = os.open

    def recording_open(file: str | os.PathLike[str], *args: Any, **kwargs: Any) -> int:
        opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    try:
        ctrl = SleepController(FakeMemory(SIZES), path)
    finally:
        monkeypatch.setattr(os, "open", real_open)
    read = {Path(name) for name in opened} & set(older)
    assert not read, f"opening read {len(read)} of {len(older)} older segments"
    assert ctrl.projection.to_dict() == replay(path).to_dict()  # the whole history gives the same state
    ctrl.sleep(1)
    ctrl.wake()
    ctrl.close()
    assert replay(path).state is State.AWAKE


@pytest.mark.parametrize("state", ["asleep_l1", "partially_awake", "awake"])
def test_wake_of_an_empty_tag_list_is_refused_naming_the_state(memory: FakeMemory, tmp_path: Path, state: str) -> None:
    """wake(tags=[]) names no tag: refused (NoTagsNamed, recorded) in every state, nothing restored, never partially_awake with nothing asked for."""
    ctl = SleepController(memory, log=tmp_path / "e.jsonl", engine="e", rank=0)
    if state != "awake":
        ctl.sleep(1)
    if state == "partially_awake":
        ctl.wake(["weights"])
    before = ctl.projection.to_dict()
    with pytest.raises(NoTagsNamed, match=rf"cannot wake tags=\[\]: it names no tag \(state '{state}' since event #"):
        ctl.wake([])
    assert ctl.state.value == state
    after = ctl.projection.to_dict()
    assert after["residency"] == before["residency"]
    assert ctl.events()[-1].kind is EventKind.REFUSED
    assert replay(tmp_path / "e.jsonl").state.value == state


@pytest.mark.parametrize(
    ("engine", "rank", "error", "needle"),
    [
        ("../escaped", 0, ValueError, "path separator"),
        ("a/b", 0, ValueError, "path separator"),
        ("..", 0, ValueError, "names no file"),
        ("", 0, ValueError, "names no file"),
        (".hidden", 0, ValueError, "starts with '.'"),
        ("new\nline", 0, ValueError, "control character"),
        ("llm", -1, ValueError, "rank -1 is refused"),
        ("llm", "0", TypeError, "rank must be an int"),
        ("llm", True, TypeError, "rank must be an int"),
        ("llm", 2**63, ValueError, "rank 9223372036854775808 is refused"),
        (7, 0, TypeError, "engine must be a str"),
    ],
)
def test_an_engine_or_rank_that_cannot_name_its_log_is_refused_before_any_file_is_made(
    tmp_path: Path, engine: object, rank: object, error: type[Exception], needle: str
) -> None:
    """A log directory with engine '../escaped', '..', '' or a rank of -1 or '0': refused at once naming the value, and no file is created anywhere."""
    logs = tmp_path / "logs" / "sub"
    with pytest.raises(error, match=re.escape(needle)):
        SleepController(FakeMemory(SIZES), log=logs, engine=engine, rank=rank)  # type: ignore[arg-type]
    assert not any(tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))


def test_an_engine_name_that_names_no_file_may_be_any_label(tmp_path: Path) -> None:
    """Without a log directory the engine name is a label only: quotes, separators and spaces are taken (a newline is not: test_enginename)."""
    ctl = SleepController(FakeMemory(SIZES), engine='odd "name"/with 模型 breaks', rank=3)
    ctl.sleep(1)
    assert ctl.projection.engine == 'odd "name"/with 模型 breaks'


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, float("inf"), "5", True])
def test_wait_for_refuses_a_timeout_that_is_no_finite_number_of_seconds(ctl: SleepController, timeout: Any) -> None:
    """wait_for(timeout=nan) blocked forever: nan, a negative, inf or a non-number is a ValueError at once, as Client.wait_for's."""
    outcome: list[BaseException | bool] = []

    def wait() -> None:
        try:
            outcome.append(ctl.wait_for("asleep_l1", timeout=timeout))
        except Exception as exc:  # what the caller of wait_for would see
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(2)
    assert outcome and isinstance(outcome[0], ValueError), outcome or "wait_for still blocks"
    assert "finite number of seconds >= 0" in str(outcome[0])
    with pytest.raises(ValueError, match="finite number of seconds >= 0"):
        asyncio.run(ctl.wait_for_async("asleep_l1", timeout=timeout))
    assert ctl.wait_for("awake", timeout=None) and ctl.wait_for("awake", timeout=0)
