"""Tests of torpor.readmodel.ranklogs: merging per-rank logs into an engine-wide view."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import zlib
from pathlib import Path

import pytest

from torpor.errors import LogCorrupted
from torpor.hooks import FleetError, FleetView, fleet, wait_fleet, wait_fleet_async
from torpor.readmodel.ranklogs import MAX_WORLD_SIZE, project_rank
from torpor.statemachine import EventKind, EventLog, SleepController, log_path_for, read_events, replay
from torpor.statemachine.log.reader import read_events_file
from torpor.testing import FakeMemory

TAGS = {"weights": 1 << 30, "kv_cache": 2 << 30}


def _ranks(directory: Path, n: int, engine: str = "llm", **log_args: int) -> list[SleepController]:
    return [
        SleepController(
            FakeMemory(TAGS),
            log=EventLog(log_path_for(directory, engine, r), fsync=False, **log_args),
            engine=engine,
            rank=r,
        )
        for r in range(n)
    ]


def test_all_awake(tmp_path: Path) -> None:
    """Every rank awake: the engine is awake with nothing lagging."""
    _ranks(tmp_path, 4)
    view = fleet(tmp_path)
    engine = view.engine("llm")
    assert engine.state == "awake"
    assert engine.lagging == ()
    assert [r.rank for r in engine.ranks] == [0, 1, 2, 3]
    assert view.state == "awake"
    assert "engine llm: awake, 4 ranks" in engine.summary()


def test_all_asleep_is_asleep_with_the_level(tmp_path: Path) -> None:
    """Every rank asleep at level 2: the engine is asleep (level 2)."""
    for c in _ranks(tmp_path, 3):
        c.sleep(2)
    engine = fleet(tmp_path).engine("llm")
    assert engine.asleep
    assert engine.level == 2
    assert engine.matches("asleep") and engine.matches("asleep_l2") and not engine.matches("asleep_l1")
    assert "asleep (level 2)" in engine.summary()


def test_mixed_levels_are_still_asleep(tmp_path: Path) -> None:
    """Ranks asleep at different levels: asleep, with no single level."""
    a, b = _ranks(tmp_path, 2)
    a.sleep(1)
    b.sleep(2)
    engine = fleet(tmp_path).engine("llm")
    assert engine.state == "asleep"
    assert engine.level is None
    assert "mixed levels" in engine.summary()


def test_one_rank_behind_is_transitional_and_named(tmp_path: Path) -> None:
    """Three ranks asleep and one still awake: transitional, naming the awake rank as lagging."""
    ranks = _ranks(tmp_path, 4)
    for c in ranks[:3]:
        c.sleep(1)
    engine = fleet(tmp_path).engine("llm")
    assert engine.state == "transitional"
    assert engine.target == "asleep_l1"
    assert engine.lagging == (3,)
    assert engine.leader in (0, 1, 2)
    summary = engine.summary()
    assert "rank 3 (awake since #1" in summary
    assert "lagging" in summary


def test_the_last_mover_leads_during_a_wake(tmp_path: Path) -> None:
    """After a wake of some ranks the woken ones lead and the still-asleep ones lag."""
    ranks = _ranks(tmp_path, 3)
    for c in ranks:
        c.sleep(1)
    time.sleep(0.01)
    ranks[1].wake()
    engine = fleet(tmp_path).engine("llm")
    assert engine.state == "transitional"
    assert engine.target == "awake"
    assert engine.leader == 1
    assert engine.lagging == (0, 2)


def test_partial_wake_everywhere_is_partially_awake(tmp_path: Path) -> None:
    """Every rank woke weights only: the engine is partially awake (the RL weight-push window)."""
    for c in _ranks(tmp_path, 2):
        c.sleep(1)
        c.wake(["weights"])
    assert fleet(tmp_path).engine("llm").state == "partially_awake"


def test_a_missing_rank_lags(tmp_path: Path) -> None:
    """A gap in the rank numbers (or a rank below world_size without a log) lags with no log."""
    ranks = _ranks(tmp_path, 3)
    for c in ranks:
        c.sleep(1)
    log_path_for(tmp_path, "llm", 1).unlink()
    engine = fleet(tmp_path).engine("llm")
    assert engine.state == "transitional"
    assert engine.lagging == (1,)
    assert "rank 1 (no log)" in engine.summary()
    wide = fleet(tmp_path, world_size=5).engine("llm")
    assert wide.lagging == (1, 3, 4)


def test_an_unreadable_log_makes_the_engine_unknown(tmp_path: Path) -> None:
    """A rank whose log is corrupted makes the engine unknown and names that rank."""
    _ranks(tmp_path, 2)
    path = log_path_for(tmp_path, "llm", 1)
    path.write_bytes(b"garbage\n" + path.read_bytes())
    view = fleet(tmp_path)
    engine = view.engine("llm")
    assert engine.state == "unknown"
    assert engine.lagging == (1,)
    assert engine.rank(1).state == "unreadable"
    assert "checksum" in (engine.rank(1).error or "")
    assert view.state == "unknown"


def test_engines_are_kept_apart(tmp_path: Path) -> None:
    """Two engines in one directory get one view each; the directory state merges them."""
    for c in _ranks(tmp_path, 2, engine="policy"):
        c.sleep(1)
    _ranks(tmp_path, 2, engine="ref.model")
    view = fleet(tmp_path)
    assert [e.engine for e in view.engines] == ["policy", "ref.model"]
    assert view.engine("policy").state == "asleep"
    assert view.engine("ref.model").state == "awake"
    assert view.state == "transitional"
    assert fleet(tmp_path, engine="policy").state == "asleep"


def test_closed_ranks(tmp_path: Path) -> None:
    """Ranks whose controllers closed read as closed."""
    for c in _ranks(tmp_path, 2):
        c.close()
    assert fleet(tmp_path).engine("llm").state == "closed"


def test_rotated_logs_are_read_whole(tmp_path: Path) -> None:
    """A rank log that rotated many times still gives the right state."""
    ranks = _ranks(tmp_path, 2, max_bytes=1_500)
    for _ in range(8):
        for c in ranks:
            c.sleep(1)
            c.wake()
    for c in ranks:
        c.sleep(1)
    assert len(list(tmp_path.glob("llm.rank0.jsonl.*"))) > 2
    engine = fleet(tmp_path).engine("llm")
    assert engine.state == "asleep"
    assert engine.ranks[0].last_seq == ranks[0].last_seq
    path = log_path_for(tmp_path, "llm", 0)
    assert project_rank(path).to_dict() == replay(path).to_dict()
    assert next(read_events_file(path)).kind is EventKind.SNAPSHOT  # so the short path was taken


@pytest.mark.parametrize("kind", ["missing", "file", "empty"])
def test_bad_directories_raise_one_clear_error(tmp_path: Path, kind: str) -> None:
    """A missing path, a file, or a directory without rank logs raises FleetError saying which."""
    target = tmp_path / "nope"
    if kind == "file":
        target.write_text("x")
    elif kind == "empty":
        target.mkdir()
        (target / "notes.txt").write_text("x")
    expected = {"missing": "no such directory", "file": "not a directory", "empty": "no per-rank event logs"}[kind]
    with pytest.raises(FleetError, match=expected):
        fleet(target)


def test_unknown_engine_is_named(tmp_path: Path) -> None:
    """Asking for an engine that has no logs names the engines that do."""
    _ranks(tmp_path, 1)
    with pytest.raises(FleetError, match="engines there: llm"):
        fleet(tmp_path, engine="other")


def test_wait_fleet_returns_once_all_ranks_arrive(tmp_path: Path) -> None:
    """wait_fleet blocks until every rank is asleep, and gives up after its timeout otherwise."""
    ranks = _ranks(tmp_path, 2)
    assert wait_fleet(tmp_path, "asleep", timeout=0.1, poll=0.02) is None

    def sleep_all() -> None:
        time.sleep(0.1)
        for c in ranks:
            c.sleep(1)

    thread = threading.Thread(target=sleep_all)
    thread.start()
    view = wait_fleet(tmp_path, "asleep_l1", timeout=10, poll=0.02)
    thread.join(5)
    assert view is not None
    assert view.engine("llm").level == 1


def test_to_dict_is_json_ready(tmp_path: Path) -> None:
    """The view's dict form carries the state, the lagging ranks and per-tag bytes."""
    import json

    a, _ = _ranks(tmp_path, 2)
    a.sleep(1)
    data = json.loads(json.dumps(fleet(tmp_path).to_dict()))
    engine = data["engines"][0]
    assert engine["state"] == "transitional"
    assert engine["lagging"] == [1]
    assert engine["ranks"][0]["residency"]["weights"]["host"] == 1 << 30


def test_a_rank_with_only_rotated_segments_is_read(tmp_path: Path) -> None:
    """A rank whose active file is missing (crash mid-rotation) is read from its segments."""
    (c,) = _ranks(tmp_path, 1, max_bytes=1_500)
    for _ in range(4):
        c.sleep(1)
        c.wake()
    c.sleep(1)
    c.log.close()  # type: ignore[union-attr]
    active = log_path_for(tmp_path, "llm", 0)
    active.rename(active.with_name(active.name + ".999999999999"))
    engine = fleet(tmp_path).engine("llm")
    assert engine.state == "asleep"
    assert engine.ranks[0].path == active


def test_a_line_being_written_is_not_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A rank log whose last line is still being written reads quietly, as of its last complete event."""
    (c,) = _ranks(tmp_path, 1)
    c.sleep(1)
    with open(log_path_for(tmp_path, "llm", 0), "ab") as fh:
        fh.write(b'{"crc":"1234abcd","data":{')
    caplog.set_level(logging.WARNING)
    engine = fleet(tmp_path).engine("llm")
    assert engine.state == "asleep"
    assert engine.ranks[0].last_seq == c.last_seq
    assert [r.getMessage() for r in caplog.records] == []


def test_pruned_history_still_gives_the_state(tmp_path: Path) -> None:
    """With old segments pruned (keep=1), the snapshot at the head of the active file gives the state."""
    ranks = _ranks(tmp_path, 2, max_bytes=1_200, keep=1)
    for _ in range(10):
        for c in ranks:
            c.sleep(2)
            c.wake()
    ranks[0].sleep(1)
    assert len(list(tmp_path.glob("llm.rank0.jsonl.*"))) == 1  # rotated many times, one segment kept
    engine = fleet(tmp_path).engine("llm")
    assert engine.state == "transitional"
    assert engine.lagging == (1,)
    assert engine.rank(0).level == 1
    assert engine.rank(0).last_seq == ranks[0].last_seq


def test_wait_fleet_async(tmp_path: Path) -> None:
    """wait_fleet_async returns the view once the ranks arrive, without blocking the event loop."""
    ranks = _ranks(tmp_path, 2)

    async def main() -> tuple[FleetView | None, FleetView | None, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        missed = await wait_fleet_async(tmp_path, "asleep", timeout=0.05, poll=0.01)
        for c in ranks:
            c.sleep(2)
        reached = await wait_fleet_async(tmp_path, "asleep_l2", timeout=5, poll=0.01)
        tick_task.cancel()
        return missed, reached, ticks

    missed, reached, ticks = asyncio.run(main())
    assert missed is None
    assert reached is not None and reached.engine("llm").level == 2
    assert ticks >= 3  # the loop kept running while waiting


def _corrupt(path: Path, how: str) -> None:
    """Spoil one line of the log at ``path``: a flipped byte in line 5, garbage for line 2, or line 5 checksummed without a field."""
    lines = path.read_bytes().splitlines(keepends=True)
    if how == "flipped byte":
        line = bytearray(lines[4])
        at = line.index(b'"kind":"') + 9
        line[at] ^= 0x01
        lines[4] = bytes(line)
    elif how == "garbage line":
        lines[1] = b"garbage\n"
    else:  # a checksum-valid line with a field missing
        raw = json.loads(lines[4])
        del raw["crc"]
        required = next(k for k in ("tag", "level", "tags", "usage") if k in raw["data"])
        del raw["data"][required]
        body = json.dumps(raw, sort_keys=True, separators=(",", ":"))
        lines[4] = f'{{"crc":"{zlib.crc32(body.encode()) & 0xFFFFFFFF:08x}",{body[1:]}\n'.encode()
    path.write_bytes(b"".join(lines))


CORRUPTIONS = ["flipped byte", "garbage line", "missing field"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_log_corrupted_past_its_first_line_makes_the_engine_unknown(tmp_path: Path, how: str) -> None:
    """A bad line after good ones (a flipped byte, garbage, a checksummed line missing a field) is unreadable naming the line, never the state before it."""
    for c in _ranks(tmp_path, 2):
        c.sleep(1)
    path = log_path_for(tmp_path, "llm", 0)
    _corrupt(path, how)
    with pytest.raises(LogCorrupted):  # what log show and replay say of it
        replay(path)
    view = fleet(tmp_path)
    engine = view.engine("llm")
    assert engine.rank(0).state == "unreadable", engine.rank(0)
    assert engine.state == "unknown"
    assert f":{2 if how == 'garbage line' else 5}:" in (engine.rank(0).error or "")
    assert engine.rank(1).state == "asleep_l1"


@pytest.mark.parametrize("world_size", [0, -5, 4097, 20_000, 2.0, True])
def test_a_world_size_no_engine_has_is_refused(tmp_path: Path, world_size: object) -> None:
    """fleet(world_size=0 or -5) was taken, 20000 took seconds: a world size is an int from 1 to MAX_WORLD_SIZE."""
    _ranks(tmp_path, 2)
    with pytest.raises(FleetError, match=r"world_size=.* is refused"):
        fleet(tmp_path, world_size=world_size)  # type: ignore[arg-type]
    assert len(fleet(tmp_path, world_size=MAX_WORLD_SIZE).engine("llm").ranks) == MAX_WORLD_SIZE


def test_a_closed_rank_is_dated_from_its_closed_event_in_the_engine_line(tmp_path: Path) -> None:
    """fleet(): a rank whose engine closed reads "closed since #N HH:MM:SS" with N and the time of the closed event."""
    ctl = SleepController(FakeMemory({"weights": 1 << 20}), log=tmp_path, engine="llm", rank=0)
    ctl.sleep(1)
    slept = ctl.last_seq
    ctl.close()
    closed = next(e for e in read_events(tmp_path / "llm.rank0.jsonl") if e.kind is EventKind.CLOSED)
    rank = fleet(tmp_path).engine("llm").rank(0)
    assert (rank.state, rank.since, rank.since_wall) == ("closed", closed.seq, closed.wall)
    assert closed.seq > slept and f"closed since #{closed.seq} " in rank.describe()


@pytest.mark.parametrize("where", ["empty", "missing", "other engine"])
def test_wait_fleet_waits_for_an_engine_that_has_not_logged_yet(tmp_path: Path, where: str) -> None:
    """wait_fleet on a directory with no logs yet (or none of the engine, or no directory) waits for them to appear, until its timeout."""
    logs = tmp_path / "logs"
    if where != "missing":
        logs.mkdir()
    if where == "other engine":
        _ranks(logs, 1, engine="other")
    assert wait_fleet(logs, "asleep", timeout=0.05, poll=0.01, engine="llm") is None  # raised FleetError at once
    assert asyncio.run(wait_fleet_async(logs, "asleep", timeout=0.05, poll=0.01, engine="llm")) is None

    def start_then_sleep() -> None:
        time.sleep(0.2)
        logs.mkdir(exist_ok=True)
        _ranks(logs, 1)[0].sleep(1)

    thread = threading.Thread(target=start_then_sleep)
    thread.start()
    view = wait_fleet(logs, "asleep", timeout=30, poll=0.02, engine="llm")
    thread.join(5)
    assert view is not None and view.engine("llm").state == "asleep" and view.engine("llm").level == 1
    (tmp_path / "file").write_text("")
    with pytest.raises(FleetError, match="not a directory"):
        wait_fleet(tmp_path / "file", "asleep", timeout=5)
