"""Tests for torpor.statemachine.log.eventlog: what a rotation reads of the active file; the writer and forked children."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import support
from support import raw_event

from torpor.errors import LogWriteFailed, TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.states import TRANSITIONAL, State
from torpor.statemachine.log import tail
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import read_events, replay, segments
from torpor.statemachine.machine.controller import SleepController
from torpor.statemachine.projection.view import Projection
from torpor.testing import FakeMemory


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
                log.append(raw_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))
            log.rotate(raw_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, snapshot))
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
        log.append(raw_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status only
            code = 3
            try:
                log.append(raw_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 2}}))
            except LogWriteFailed as exc:
                code = 0 if "forked child" in str(exc) else 4
            except BaseException:
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        log.append(raw_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 3}}))
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
        log.append(raw_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))
        with pytest.raises(LogWriteFailed, match=field):
            log.append(raw_event(EventKind.SLEEP_COMPLETED, log.next_seq(), "e", 0, data))
        log.append(raw_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 2}}))
    assert [e.seq for e in read_events(path)] == [1, 2]


# -- an exception at every step of an append: the file and the count always agree ---------------------------------

TAGS = {"weights": 4096, "kv_cache": 8192, "runtime": 1024}
CYCLE: tuple[tuple[str, Any], ...] = (("sleep", 1), ("wake", ["weights"]), ("wake", None), ("sleep", 2), ("wake", None))


class Injected(Exception):
    """Raised by a patched system call of the log's writer."""


class _RaiseAt:
    """``os.write`` or ``os.fsync`` on the log's file that raises at its ``nth`` call: before it, after half a line, or after it."""

    def __init__(self, name: str, when: str, nth: int) -> None:
        self.name, self.when, self.nth = name, when, nth
        self.real = getattr(os, name)
        self.calls = 0
        self.fd: int | None = None

    def __call__(self, fd: int, *args: Any) -> Any:
        if fd != self.fd:
            return self.real(fd, *args)
        self.calls += 1
        if self.calls != self.nth:
            return self.real(fd, *args)
        if self.when == "before":
            msg = f"os.{self.name} #{self.nth} raised before it ran"
            raise Injected(msg)
        if self.when == "partial":
            self.real(fd, args[0][: max(1, len(args[0]) // 2)])
        else:
            self.real(fd, *args)
        msg = f"os.{self.name} #{self.nth} raised {self.when} it wrote"
        raise Injected(msg)


def _run_cycle(ctrl: Any) -> int:
    """Run :data:`CYCLE`, going on past each injected exception; how many were met."""
    met = 0
    for name, arg in CYCLE:
        try:
            ctrl.sleep(arg) if name == "sleep" else ctrl.wake(arg)
        except Injected:
            met += 1
        except TorporError:  # refused after a rollback left the engine elsewhere than the cycle expects
            pass
    return met


@pytest.mark.parametrize(
    ("call", "when", "fsync"),
    [
        ("write", "before", False),
        ("write", "partial", False),
        ("write", "after", False),
        ("fsync", "before", True),
        ("fsync", "after", True),
    ],
)
def test_an_exception_at_each_write_or_fsync_of_a_cycle_leaves_log_and_controller_in_agreement(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, when: str, fsync: bool
) -> None:
    """An exception at each os.write (before, after half a line, after it) or os.fsync of a cycle: the log reads with numbers following on, the controller agrees, every later command and a restart work."""
    cells = support.count_log_calls(call, _RaiseAt(call, "never", 0), _run_cycle, TAGS, fsync, tmp_path, monkeypatch)
    assert cells >= 8, f"a cycle makes only {cells} {call} calls on the log"
    problems: list[str] = []
    for nth in range(1, cells + 1):
        where = f"os.{call} #{nth} ({when})"
        path = tmp_path / f"cell{nth}" / "e.jsonl"
        ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=fsync))
        assert ctrl.log is not None
        inject = _RaiseAt(call, when, nth)
        inject.fd = ctrl.log._fd
        monkeypatch.setattr(os, call, inject)
        try:
            met = _run_cycle(ctrl)
        except (TorporError, ValueError) as exc:
            problems.append(f"{where}: the cycle broke: {type(exc).__name__}: {exc}")
            met = 1
        finally:
            monkeypatch.setattr(os, call, inject.real)
        if met != 1:
            problems.append(f"{where}: the exception was {'swallowed' if not met else 'repeated'}")
        try:
            seqs = [e.seq for e in read_events(path)]
            if seqs != list(range(1, len(seqs) + 1)) or seqs[-1] != ctrl.last_seq:
                problems.append(
                    f"{where}: the log holds #{seqs[0]}..#{seqs[-1]}, the controller is at #{ctrl.last_seq}"
                )
            if replay(path).to_dict() != ctrl.projection.to_dict():
                problems.append(f"{where}: the log ({replay(path).state}) and the controller ({ctrl.state}) disagree")
            if ctrl.state in TRANSITIONAL:
                problems.append(f"{where}: the controller is left in {ctrl.state.value}")
            if ctrl.projection.interrupted:
                ctrl.recover()
            if ctrl.state is not State.AWAKE:
                ctrl.wake()
            ctrl.sleep(1)
            ctrl.wake()
            ctrl.close()
            SleepController(FakeMemory(TAGS), path).close()  # a restarted engine reads it
        except (TorporError, ValueError) as exc:
            problems.append(f"{where}: afterwards: {type(exc).__name__}: {exc}")
    assert not problems, "\n".join(problems[:8])


@pytest.mark.parametrize(
    ("limits", "needle"),
    [
        ({"keep": -1}, "keep=-1 is refused"),
        ({"keep": 1.5}, "keep=1.5 is refused"),
        ({"max_bytes": 0}, "max_bytes=0 is refused"),
        ({"max_bytes": -4096}, "max_bytes=-4096 is refused"),
        ({"max_bytes": 100}, "max_bytes=100 is refused"),
        ({"max_line": 0}, "max_line=0 is refused"),
    ],
)
def test_limits_that_would_prune_everything_or_rotate_every_event_are_refused(
    tmp_path: Path, limits: dict[str, Any], needle: str
) -> None:
    """EventLog(keep=-1) (it pruned every segment) and max_bytes=0 (it rotated after every event) are a ValueError before any file is made."""
    with pytest.raises(ValueError, match=re.escape(needle)):
        EventLog(tmp_path / "logs" / "e.jsonl", fsync=False, **limits)
    assert not any(tmp_path.iterdir())


def test_keep_zero_keeps_only_the_active_file(tmp_path: Path) -> None:
    """keep=0 is taken: every rotated segment is pruned, the active file reads from its snapshot."""
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=False, max_bytes=2_000, keep=0))
    for _ in range(10):
        ctrl.sleep(1)
        ctrl.wake()
    assert segments(path) == [path]
    assert replay(path).to_dict() == ctrl.projection.to_dict()
    ctrl.close()
