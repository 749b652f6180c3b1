"""Tests of torpor.statemachine.log.follow: tailing a rank's event log across appends, rotation and resumes."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torpor.errors import LogCorrupted, TorporError
from torpor.hooks import Follower, follow, follow_async
from torpor.statemachine import EventKind, EventLog, SleepController, log_path_for, read_events, segments
from torpor.testing import FakeMemory

TAGS = {"weights": 1 << 30, "kv_cache": 2 << 30, "cudagraph": 1 << 20}


def _controller(directory: Path, **log_args: int) -> SleepController:
    path = log_path_for(directory, "llm", 0)
    log = EventLog(path, fsync=False, **log_args)
    return SleepController(FakeMemory(TAGS), log=log, engine="llm", rank=0)


def _crash(controller: SleepController) -> None:
    """Close the controller's log file as a dying process would: no ``closed`` event (the controller stays open)."""
    if controller.log is not None:
        controller.log.close()


def _cycle(controller: SleepController, n: int = 1) -> None:
    for _ in range(n):
        controller.sleep(1)
        controller.wake(["weights"])
        controller.wake(["kv_cache"])


def test_reads_what_is_on_disk_in_order(tmp_path: Path) -> None:
    """A follower returns every event already written, in order, once."""
    c = _controller(tmp_path)
    _cycle(c)
    f = Follower(c.log_path)
    got = f.read_available()
    assert [e.seq for e in got] == list(range(1, c.last_seq + 1))
    assert f.read_available() == []
    assert f.last_seq == c.last_seq
    f.close()


def test_resumes_after_a_sequence_number(tmp_path: Path) -> None:
    """after=SEQ yields only the events after SEQ."""
    c = _controller(tmp_path)
    _cycle(c, 2)
    with Follower(c.log_path, after=5) as f:
        assert [e.seq for e in f.read_available()] == list(range(6, c.last_seq + 1))


def test_follow_sees_events_as_they_are_appended(tmp_path: Path) -> None:
    """follow() yields events a writer appends while it waits, then ends when stopped."""
    c = _controller(tmp_path)
    path = c.log_path
    stop = threading.Event()
    got: list[str] = []

    def reader() -> None:
        for event in follow(path, poll=0.01, stop=stop):
            got.append(event.kind.value)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.05)
    c.sleep(1)
    time.sleep(0.05)
    c.wake()
    time.sleep(0.05)
    stop.set()
    thread.join(5)
    assert not thread.is_alive()
    assert got[0] == "opened"
    assert got.count("sleep_completed") == 1
    assert got[-1] == "wake_completed"
    assert [e.kind.value for e in read_events(path)] == got


def test_follow_waits_for_the_log_to_appear(tmp_path: Path) -> None:
    """Started before the engine, follow() waits for the file and then yields from its first event."""
    path = log_path_for(tmp_path, "llm", 0)
    stop = threading.Event()
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.extend(e.seq for e in follow(path, poll=0.01, stop=stop)))
    thread.start()
    time.sleep(0.05)
    c = _controller(tmp_path)
    c.sleep(2)
    time.sleep(0.05)
    stop.set()
    thread.join(5)
    assert got == list(range(1, c.last_seq + 1))


def test_survives_rotation_without_gaps_or_repeats(tmp_path: Path) -> None:
    """Across many rotations the follower yields every sequence number exactly once, snapshots included."""
    c = _controller(tmp_path, max_bytes=2_000)
    path = c.log_path
    f = Follower(path)
    seen: list[int] = []
    kinds: list[EventKind] = []
    for _ in range(12):
        _cycle(c)
        got = f.read_available()
        seen += [e.seq for e in got]
        kinds += [e.kind for e in got]
    f.close()
    assert len(segments(path)) > 3
    assert seen == list(range(1, c.last_seq + 1))
    assert EventKind.SNAPSHOT in kinds


def test_catches_up_over_several_rotations_at_once(tmp_path: Path) -> None:
    """A follower that was away during several rotations reads the rotated segments it missed."""
    c = _controller(tmp_path, max_bytes=1_500)
    path = c.log_path
    f = Follower(path)
    first = f.read_available()
    _cycle(c, 10)
    rest = f.read_available()
    f.close()
    assert [e.seq for e in first + rest] == list(range(1, c.last_seq + 1))


def test_resume_inside_a_rotated_segment(tmp_path: Path) -> None:
    """after=SEQ pointing into an old segment resumes there and skips older segments."""
    c = _controller(tmp_path, max_bytes=1_500)
    _cycle(c, 10)
    path = c.log_path
    middle = c.last_seq // 2
    with Follower(path, after=middle) as f:
        assert [e.seq for e in f.read_available()] == list(range(middle + 1, c.last_seq + 1))


def test_pruned_segments_warn_and_continue(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Events pruned from disk are reported once as a gap; following continues with what exists."""
    c = _controller(tmp_path, max_bytes=1_500, keep=1)
    _cycle(c, 10)
    path = c.log_path
    with Follower(path, after=1) as f:
        got = f.read_available()
    assert got[-1].seq == c.last_seq
    assert [e.seq for e in got] == list(range(got[0].seq, c.last_seq + 1))
    assert got[0].seq > 2
    assert any("no longer on disk" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_torn_line_waits_until_it_is_complete(tmp_path: Path) -> None:
    """Half a line is held back until the rest of it (and its newline) arrives."""
    c = _controller(tmp_path)
    path = c.log_path
    c.close()
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:-1]) + lines[-1][:20])
    f = Follower(path)
    assert [e.seq for e in f.read_available()] == list(range(1, len(lines)))
    with open(path, "ab") as fh:
        fh.write(lines[-1][20:])
    assert [e.kind for e in f.read_available()] == [EventKind.CLOSED]
    f.close()


def test_a_torn_line_cut_by_the_writer_is_dropped(tmp_path: Path) -> None:
    """When a restarted writer cuts a torn last line off and appends, the follower reads the new line cleanly."""
    c = _controller(tmp_path)
    path = c.log_path
    _crash(c)
    with open(path, "ab") as fh:
        fh.write(b'{"crc":"0000')  # a crash mid-write
    f = Follower(path)
    before = f.read_available()
    c2 = SleepController(FakeMemory(TAGS), log=EventLog(path, fsync=False), engine="llm", rank=0)
    c2.sleep(1)
    after = f.read_available()
    f.close()
    assert [e.seq for e in before + after] == list(range(1, c2.last_seq + 1))
    assert after[-1].kind is EventKind.SLEEP_COMPLETED


def test_a_new_log_in_the_same_place_is_followed_from_its_start(tmp_path: Path) -> None:
    """If the log is deleted and started anew, the follower starts over at its event #1."""
    c = _controller(tmp_path)
    _cycle(c)
    path = c.log_path
    f = Follower(path)
    f.read_available()
    c.close()
    path.unlink()
    c2 = _controller(tmp_path)
    c2.sleep(1)
    got = f.read_available()
    f.close()
    assert got[0].kind is EventKind.CLOSED  # the end of the old log, read before it is let go
    assert [e.seq for e in got[1:]] == list(range(1, c2.last_seq + 1))


def test_a_corrupted_line_raises(tmp_path: Path) -> None:
    """A line with a bad checksum is an error, not skipped."""
    c = _controller(tmp_path)
    path = c.log_path
    c.close()
    data = path.read_bytes().replace(b'"opened"', b'"OPENED"', 1)
    path.write_bytes(data)
    with Follower(path) as f, pytest.raises(LogCorrupted, match="checksum"):
        f.read_available()


def test_stop_callable_ends_follow(tmp_path: Path) -> None:
    """A callable stop ends follow() once it returns True, after yielding what is on disk."""
    c = _controller(tmp_path)
    c.sleep(1)
    got = list(follow(c.log_path, stop=lambda: True))
    assert [e.seq for e in got] == list(range(1, c.last_seq + 1))


def test_follow_async_yields_new_events(tmp_path: Path) -> None:
    """follow_async yields events appended while it awaits and ends on an asyncio.Event."""
    c = _controller(tmp_path)
    path = c.log_path

    async def main() -> list[str]:
        stop = asyncio.Event()
        got: list[str] = []

        async def consume() -> None:
            async for event in follow_async(path, poll=0.01, stop=stop):
                got.append(event.kind.value)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.03)
        c.sleep(1)
        await asyncio.sleep(0.03)
        stop.set()
        await asyncio.wait_for(task, 5)
        return got

    got = asyncio.run(main())
    assert got[0] == "opened"
    assert got[-1] == "sleep_completed"


def test_idle_timeout_ends_a_quiet_follow(tmp_path: Path) -> None:
    """idle_timeout ends follow() after that long without a new event, having yielded what exists."""
    c = _controller(tmp_path)
    start = time.monotonic()
    got = list(follow(c.log_path, poll=0.01, idle_timeout=0.1))
    assert 0.1 <= time.monotonic() - start < 5
    assert [e.seq for e in got] == [1]


def test_kinds_filter(tmp_path: Path) -> None:
    """kinds keeps only the events of those kinds."""
    c = _controller(tmp_path)
    _cycle(c)
    got = list(follow(c.log_path, kinds=["sleep_completed", EventKind.WAKE_COMPLETED], stop=lambda: True))
    assert [e.kind.value for e in got] == ["sleep_completed", "wake_completed", "wake_completed"]


def test_after_beyond_the_end_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Resuming after a sequence number the log never reached warns once (a new log?) and waits."""
    c = _controller(tmp_path)
    with Follower(c.log_path, after=500) as f:
        assert f.read_available() == []
        assert f.read_available() == []
    warnings = [r.getMessage() for r in caplog.records if "before after=#500" in r.getMessage()]
    assert len(warnings) == 1


def test_events_before_a_bad_line_are_delivered_then_it_raises(tmp_path: Path) -> None:
    """Good events before a corrupted line come out first; the next read raises, and keeps raising."""
    c = _controller(tmp_path)
    c.sleep(1)
    path = c.log_path
    _crash(c)
    good = len(path.read_bytes().splitlines())
    with open(path, "ab") as fh:
        fh.write(b'{"crc":"00000000","schema":1}\n')
    with Follower(path) as f:
        assert [e.seq for e in f.read_available()] == list(range(1, good + 1))
        for _ in range(2):
            with pytest.raises(LogCorrupted, match=f":{good + 1}: "):
                f.read_available()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.sampled_from(["sleep1", "sleep2", "wake", "wake_weights", "read", "reopen"]), max_size=40),
    max_bytes=st.integers(min_value=600, max_value=6_000),
)
def test_any_interleaving_yields_every_event_once(
    tmp_path_factory: pytest.TempPathFactory, ops: list[str], max_bytes: int
) -> None:
    """Whatever the interleaving of commands, rotations, writer restarts and reads, each event comes out once, in order."""
    directory = tmp_path_factory.mktemp("log")
    path = log_path_for(directory, "llm", 0)
    memory = FakeMemory(TAGS)

    def open_controller() -> SleepController:
        log = EventLog(path, fsync=False, max_bytes=max_bytes)
        return SleepController(memory, log=log, engine="llm", rank=0)

    c = open_controller()
    f = Follower(path)
    seen: list[int] = []
    for op in ops:
        try:
            if op == "sleep1":
                c.sleep(1)
            elif op == "sleep2":
                c.sleep(2)
            elif op == "wake":
                c.wake()
            elif op == "wake_weights":
                c.wake(["weights"])
            elif op == "reopen":
                _crash(c)
                c = open_controller()
            else:
                seen += [e.seq for e in f.read_available()]
        except TorporError:
            pass  # a command the state does not allow: refused and logged, which is an event too
    seen += [e.seq for e in f.read_available()]
    f.close()
    assert seen == list(range(1, c.last_seq + 1))
