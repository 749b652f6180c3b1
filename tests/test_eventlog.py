"""Tests for torpor.statemachine.log.eventlog: what a rotation reads of the active file; the writer and forked children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from torpor.errors import LogWriteFailed
from torpor.statemachine.core.events import EventKind, make_event
from torpor.statemachine.log import tail
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import read_events, segments
from torpor.statemachine.projection.view import Projection


def test_a_rotation_reads_only_the_first_line_of_the_active_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rotating names the segment from its first event without reading the whole file (the writer lock is held)."""
    path = tmp_path / "e.rank0.jsonl"

    def whole_file(file: Any) -> Any:
        msg = f"a rotation read the whole of {file}"
        raise AssertionError(msg)

    snapshot = {"projection": Projection().to_dict()}
    with EventLog(path, fsync=False, max_bytes=600) as log:
        monkeypatch.setattr(tail, "batches", whole_file)
        for _ in range(3):
            for _ in range(10):
                log.append(make_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))
            log.rotate(make_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, snapshot))
        monkeypatch.undo()
    assert len(segments(path)) == 4
    assert [e.seq for e in read_events(path)] == list(range(1, 34))


_FORKING_ENGINE = """
import multiprocessing, sys, time
from torpor.statemachine.machine.controller import SleepController
from torpor.testing import FakeMemory
ctrl = SleepController(FakeMemory({"weights": 4096}), sys.argv[1])
helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=False)
helper.start()
ctrl.sleep(1)
print(helper.pid, flush=True)
time.sleep(60)
"""


def test_the_writer_lock_dies_with_the_writer_not_with_a_forked_child(tmp_path: Path) -> None:
    """An engine that forked a helper is SIGKILLed: the restarted engine opens the log (the helper holds no lock)."""
    path = tmp_path / "e.rank0.jsonl"
    engine = subprocess.Popen([sys.executable, "-c", _FORKING_ENGINE, str(path)], stdout=subprocess.PIPE, text=True)
    helper = 0
    try:
        assert engine.stdout is not None
        helper = int(engine.stdout.readline())
        engine.kill()
        engine.wait(30)
        with EventLog(path, fsync=False) as log:  # the engine restarted: it is the writer again
            assert log.last_seq == max(e.seq for e in read_events(path))
        assert list(read_events(path))[-1].kind is EventKind.SLEEP_COMPLETED
    finally:
        engine.kill()
        engine.wait(30)
        if helper:
            with contextlib.suppress(ProcessLookupError):
                os.kill(helper, signal.SIGKILL)


def test_a_forked_child_cannot_write_the_parents_log(tmp_path: Path) -> None:
    """In a forked child the parent's EventLog refuses to append (LogWriteFailed: it is not the writer) and leaves the file alone."""
    path = tmp_path / "e.rank0.jsonl"
    with EventLog(path, fsync=False) as log:
        log.append(make_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            code = 3
            try:
                log.append(make_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 2}}))
            except LogWriteFailed as exc:
                code = 0 if "forked child" in str(exc) else 4
            except BaseException:
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        log.append(make_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 3}}))
    assert [e.data["usage"]["weights"] for e in read_events(path)] == [1, 3]


@pytest.mark.parametrize(
    ("field", "value"),
    [("host_budget", 2**64), ("freed", -1), ("seconds", float("inf")), ("level", "one")],
)
def test_an_event_that_would_not_read_back_is_refused_and_nothing_is_written(
    tmp_path: Path, field: str, value: Any
) -> None:
    """The writer refuses (LogWriteFailed naming the field) an event its readers would call corrupted; the log reads on."""
    path = tmp_path / "e.rank0.jsonl"
    data = {"level": 1, "seconds": 0.1, "freed": 0, "offloaded": 0, "discarded": 0, "pinned": 0, field: value}
    with EventLog(path, fsync=False) as log:
        log.append(make_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))
        with pytest.raises(LogWriteFailed, match=field):
            log.append(make_event(EventKind.SLEEP_COMPLETED, log.next_seq(), "e", 0, data))
        log.append(make_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 2}}))
    assert [e.seq for e in read_events(path)] == [1, 2]
