"""Tests for torpor.statemachine.log.logsource: a source that replays and follows an event log written elsewhere."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from torpor import EventLog, SleepController, replay
from torpor.statemachine.log.logsource import LogSource, resolve_log
from torpor.statemachine.log.reader import segments
from torpor.telemetry import serve
from torpor.testing import FakeMemory

TAGS = {"weights": 4000, "kv_cache": 8000, "cudagraph": 300}


def writer(directory: Path, **log: int) -> SleepController:
    """A controller writing ``directory/w.rank0.jsonl`` (no fsync; optional rotation size)."""
    path = directory / "w.rank0.jsonl"
    return SleepController(FakeMemory(TAGS), log=EventLog(path, fsync=False, **log), engine="w", rank=0)


def comparable(projection_dict: dict[str, object]) -> dict[str, object]:
    """A projection without the fields that only name the last step."""
    return {k: v for k, v in projection_dict.items() if k not in ("last_step",)}


def test_replays_an_existing_log(tmp_path: Path) -> None:
    """On start the source's projection is the log's replay, with its engine and rank."""
    controller = writer(tmp_path)
    controller.sleep(1)
    source = LogSource(tmp_path / "w.rank0.jsonl")
    try:
        assert source.projection.to_dict() == replay(tmp_path / "w.rank0.jsonl").to_dict()
        assert (source.engine, source.rank, source.last_seq) == ("w", 0, controller.last_seq)
        assert [e.seq for e in source.events(0)] == list(range(1, controller.last_seq + 1))
    finally:
        source.close()


def test_follows_appended_events_and_calls_subscribers(tmp_path: Path) -> None:
    """Events appended after start reach the projection and the subscribers, once each."""
    controller = writer(tmp_path)
    source = LogSource(tmp_path / "w.rank0.jsonl", poll=60)
    seen: list[int] = []
    source.subscribe(lambda e: seen.append(e.seq))
    try:
        mark = controller.last_seq
        controller.sleep(1)
        assert source.refresh() == controller.last_seq - mark
        assert source.refresh() == 0
        assert seen == list(range(mark + 1, controller.last_seq + 1))
        assert source.projection.state.value == "asleep_l1"
        assert comparable(source.projection.to_dict()) == comparable(controller.projection.to_dict())
    finally:
        source.close()


def test_a_line_being_written_waits_for_its_newline(tmp_path: Path) -> None:
    """A partial last line is left for the next look, then read whole."""
    controller = writer(tmp_path)
    controller.sleep(1)
    path = tmp_path / "w.rank0.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:20])
    source = LogSource(path, poll=60)
    try:
        assert source.last_seq == controller.last_seq - 1
        with path.open("ab") as fh:
            fh.write(lines[-1][20:])
        assert source.refresh() == 1
        assert source.projection.state.value == "asleep_l1"
    finally:
        source.close()


def test_follows_across_a_rotation(tmp_path: Path) -> None:
    """When the writer rotates its log, the source reads the new segment from the last event it saw."""
    controller = writer(tmp_path, max_bytes=3000)
    source = LogSource(tmp_path / "w.rank0.jsonl", poll=60)
    try:
        for _ in range(6):
            controller.sleep(1)
            controller.wake()
            source.refresh()
        assert len(segments(tmp_path / "w.rank0.jsonl")) > 2
        assert source.last_seq == controller.last_seq
        assert source.projection.state == controller.state
        seqs = [e.seq for e in source.events(0)]
        assert seqs == sorted(set(seqs))
    finally:
        source.close()


def test_missing_log_is_refused(tmp_path: Path) -> None:
    """A path with no log is a FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match="no event log"):
        LogSource(tmp_path / "nothing.jsonl")


def test_resolve_log_picks_the_one_log_of_a_directory(tmp_path: Path) -> None:
    """A directory with one ENGINE.rankN.jsonl resolves to it; with several, --rank decides."""
    writer(tmp_path)
    assert resolve_log(tmp_path) == tmp_path / "w.rank0.jsonl"
    SleepController(FakeMemory(TAGS), log=tmp_path, engine="w", rank=1, fsync=False)
    with pytest.raises(ValueError, match="--engine and --rank"):
        resolve_log(tmp_path)
    assert resolve_log(tmp_path, "w", 1).name == "w.rank1.jsonl"


def test_serve_a_log_directory(tmp_path: Path) -> None:
    """serve(path) answers /state and /metrics from the log, and /events long-polls for the writer's next event."""
    controller = writer(tmp_path)
    with serve(tmp_path, 0) as server:
        with urllib.request.urlopen(server.url + "/state", timeout=10) as r:  # noqa: S310 - loopback
            assert json.loads(r.read())["state"] == "awake"
        mark = controller.last_seq
        controller.sleep(2)
        start = time.monotonic()
        with urllib.request.urlopen(f"{server.url}/events?after={mark}&wait=10", timeout=15) as r:  # noqa: S310
            first = json.loads(r.read().splitlines()[0])
        assert first["seq"] == mark + 1
        assert time.monotonic() - start < 5
        deadline = time.monotonic() + 30  # the sidecar polls the file; wait for the state, do not race it
        while time.monotonic() < deadline:
            with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:  # noqa: S310
                body = r.read()
            if b'torpor_state{state="asleep_l2",torpor_engine="w",torpor_rank="0"} 1.0' in body:
                break
            time.sleep(0.1)
        assert b'torpor_state{state="asleep_l2",torpor_engine="w",torpor_rank="0"} 1.0' in body


def test_resolve_log_takes_any_one_log_and_says_what_a_narrowing_missed(tmp_path: Path) -> None:
    """A directory's one *.jsonl resolves whatever its name; an engine/rank that matches none is FileNotFoundError."""
    SleepController(FakeMemory(TAGS), log=tmp_path / "custom.jsonl", fsync=False).close()
    assert resolve_log(tmp_path) == tmp_path / "custom.jsonl"
    with pytest.raises(FileNotFoundError, match="of that engine and rank"):
        resolve_log(tmp_path, rank=3)
    with pytest.raises(FileNotFoundError, match="no event log at"):
        resolve_log(tmp_path / "absent.jsonl")


def test_a_log_started_anew_serves_only_the_new_logs_events(tmp_path: Path) -> None:
    """After the log restarts at #1, events(after=0) holds the new run's events only, not the old run's beside them."""
    log = tmp_path / "e.rank0.jsonl"
    old = SleepController(FakeMemory({"weights": 64}), log=log, engine="e", fsync=False)
    old.sleep(1)
    old.wake()
    old.close()
    source = LogSource(log, poll=0.05)
    try:
        assert len(source.events(0)) == old.last_seq
        log.unlink()
        new = SleepController(FakeMemory({"weights": 64}), log=log, engine="e", fsync=False)
        deadline = time.monotonic() + 10
        while source.last_seq != new.last_seq or source.projection.pid != new.projection.pid:
            assert time.monotonic() < deadline, "the source never read the new log"
            time.sleep(0.05)
        assert [e.seq for e in source.events(0)] == [e.seq for e in new.events()]
        new.close()
    finally:
        source.close()
