"""Interrupts and shutdown: Ctrl-C inside any driver call of a sleep or wake rolls back and re-raises; close() is clean.

The interrupt matrix reuses the fault matrix's scenarios and its simulated
device rig: every driver call that a sleep or a wake makes (from a dry run) in
turn raises ``KeyboardInterrupt`` instead of returning.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest
import support
from support import hold_call
from test_reliability_faults import (
    Case,
    SimMatrixRig,
    _agree,
    _arm,
    _cases,
    _check_offloaded_back,
    _finish,
    _offloaded,
    _run,
    _sim_available,
)

from torpor.cli import main
from torpor.errors import (
    CommandInFlight,
    ControllerClosed,
    LogWriteFailed,
    MemoryOperationFailed,
    NotRecovered,
    TorporError,
)
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.states import TRANSITIONAL, State
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import replay
from torpor.statemachine.machine.controller import SleepController
from torpor.testing import FakeMemory

TAGS = {"weights": 4096, "kv_cache": 8192, "runtime": 1024}
WORKER = Path(__file__).with_name("crash_worker.py")


class _Interrupting:
    """The native library as the allocator and the simulated device see it, raising Ctrl-C once a call has run.

    CPython delivers SIGINT between bytecodes: a Ctrl-C that arrives while the
    native library runs a driver call (most of them run inside the C table)
    is raised as ``KeyboardInterrupt`` right after that library call returns
    to Python. This proxy does exactly that for the ``nth`` next ``call``.
    """

    def __init__(self, lib: Any, driver: Any, call: str, nth: int) -> None:
        self._lib = lib
        self._driver = driver
        self._index = driver.CALLS.index(call)
        self._call = call
        self._target = self._count() + nth
        self.fired = False

    def _count(self) -> int:
        lib, sim = self._lib, self._driver.native_sim
        n = int(lib.tp_sim_log(sim, 0, None, 0))
        buf = ctypes.create_string_buffer(max(n, 1))
        lib.tp_sim_log(sim, 0, buf, n)
        return sum(1 for b in buf.raw[:n] if b & 0x7F == self._index)

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._lib, name)
        if not callable(real) or name.startswith("tp_sim_log"):
            return real

        def call(*args: Any) -> Any:
            result = real(*args)
            if not self.fired and self._count() >= self._target:
                self.fired = True
                msg = f"Ctrl-C during {self._call}"
                raise KeyboardInterrupt(msg)
            return result

        return call


class InterruptRig(SimMatrixRig):
    """The simulated device, where Ctrl-C arrives during an armed driver call."""

    def arm(self, key: Hashable, nth: int) -> None:
        """The ``nth`` next call ``key`` is interrupted (raised when the library returns to Python)."""
        table = self.allocator._table
        proxy = _Interrupting(table.lib, self.driver, str(key), nth)
        table.lib = proxy
        self.driver.lib = proxy


def _interrupt_matrix() -> list[Any]:
    if not _sim_available():
        return [pytest.param(None, id="sim-not-built", marks=pytest.mark.skip(reason="TaggedAllocator not built"))]
    return [pytest.param(case, id=str(case)) for case in _cases("sim")]


@pytest.mark.parametrize("case", _interrupt_matrix())
def test_interrupt_at_each_driver_call_rolls_back(tmp_path: Path, case: Case) -> None:
    """Ctrl-C at each driver call of each sleep and wake: re-raised, rolled back, log agrees, every offloaded byte exact."""
    rig = InterruptRig()
    try:
        ctrl, path, commands, level, original, state, seq = _arm(rig, case, tmp_path)
        interrupted = False
        try:
            _run(ctrl, commands[case.step])
        except KeyboardInterrupt:
            interrupted = True
        assert interrupted, f"the interrupt in {case.key} was swallowed"
        assert ctrl.state not in TRANSITIONAL, f"left in {ctrl.state}"
        kinds = [e.kind for e in ctrl.events(after=seq)]
        if ctrl.state is state:  # rolled back, and says so
            assert {EventKind.SLEEP_ABORTED, EventKind.WAKE_FAILED} & set(kinds), kinds
        else:  # interrupted after the command was complete (dropping backups after a wake): it stands
            assert kinds[-1] in (EventKind.WAKE_COMPLETED, EventKind.SLEEP_COMPLETED), kinds
        _agree(ctrl, path)
        _finish(ctrl, commands[case.step + 1 :])
        _check_offloaded_back(rig, case, level, original)
        rig.scribble()
        again = rig.content()
        ctrl.sleep(1)
        ctrl.wake()
        assert {t: rig.content()[t] for t in _offloaded(1)} == {t: again[t] for t in _offloaded(1)}
        _agree(ctrl, path)
    finally:
        rig.close()


def test_recover_reconciles_with_the_memory_as_it_is(tmp_path: Path) -> None:
    """Left mid-sleep with tags really released (the disk filled, then the rollback failed): recover() says partially awake."""
    memory = FakeMemory(TAGS)
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(memory, EventLog(path, fsync=False))
    before = {t: memory.content(t) for t in TAGS}
    disk_full = _fill_disk_at(ctrl, path, EventKind.TAG_RELEASED, "weights")
    memory.fail_once("restore", "weights")  # and mapping weights back fails too
    with pytest.raises(MemoryOperationFailed, match="rolling back failed too"):
        ctrl.sleep(1)
    assert ctrl.state is State.SUSPENDING  # the log could record nothing more
    assert memory.content("weights") is None and memory.content("runtime") is None
    disk_full[0] = False  # space is back
    proj = ctrl.recover()
    assert proj.state is State.PARTIALLY_AWAKE
    assert proj.asleep_tags() == ["runtime", "weights"]
    assert replay(path).to_dict() == proj.to_dict()
    ctrl.wake()
    assert ctrl.state is State.AWAKE
    assert {t: memory.content(t) for t in ("weights", "runtime")} == {t: before[t] for t in ("weights", "runtime")}
    assert replay(path).to_dict() == ctrl.projection.to_dict()


def _fill_disk_at(ctrl: SleepController, path: Path, kind: EventKind, tag: str) -> list[bool]:
    """From the next ``kind`` event of ``tag`` on, every append fails with ENOSPC until the returned flag is cleared."""
    log = ctrl.log
    assert log is not None
    real_append = log.append
    full, armed = [False], [True]

    def append(event: Any) -> None:
        if armed[0] and event.kind is kind and event.data.get("tag") == tag:
            full[0], armed[0] = True, False
        if full[0]:
            raise LogWriteFailed(str(path), event.kind.value, event.seq, "[Errno 28] No space left on device")
        real_append(event)

    log.append = append  # type: ignore[method-assign]
    return full


def test_close_waits_for_a_command_in_flight(tmp_path: Path) -> None:
    """close() while a sleep is in flight waits for it, then closes; the log ends with the sleep and 'closed'."""
    memory = FakeMemory(TAGS)
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(memory, EventLog(path, fsync=False))
    inside, go_on = hold_call(memory, "release", wait=30)
    sleeper = threading.Thread(target=ctrl.sleep, args=(1,))
    sleeper.start()
    assert inside.wait(30)
    with pytest.raises(CommandInFlight, match="sleep"):
        ctrl.close(timeout=0)  # with a deadline that passes: refused, nothing closed
    closer = threading.Thread(target=ctrl.close)
    closer.start()
    go_on.set()
    sleeper.join(30)
    closer.join(30)
    assert not sleeper.is_alive() and not closer.is_alive()
    kinds = [e.kind for e in ctrl.events()]
    assert kinds[-2:] == [EventKind.SLEEP_COMPLETED, EventKind.CLOSED]
    assert replay(path).state is State.ASLEEP_L1


def test_commands_after_close_raise_controller_closed(tmp_path: Path) -> None:
    """After close(), every command and record raises ControllerClosed (not a ValueError on a closed file); close twice is fine."""
    ctrl = SleepController(FakeMemory(TAGS), EventLog(tmp_path / "e.jsonl", fsync=False))
    ctrl.close()
    ctrl.close()
    for command in (
        lambda: ctrl.sleep(1),
        ctrl.wake,
        lambda: ctrl.discard(["kv_cache"]),
        ctrl.release_cudagraph_pool,
        ctrl.recover,
        ctrl.observe,
        lambda: ctrl.record(EventKind.HOOK_DECISION, hook="x", active=True, detail=""),
    ):
        with pytest.raises(ControllerClosed, match="closed at event #"):
            command()
    assert [e.kind for e in replay_events(tmp_path / "e.jsonl")].count(EventKind.CLOSED) == 1


def test_close_from_inside_a_command_is_refused(tmp_path: Path) -> None:
    """close() from a subscriber (inside a command) raises CommandInFlight instead of deadlocking."""
    ctrl = SleepController(FakeMemory(TAGS), EventLog(tmp_path / "e.jsonl", fsync=False))
    seen: list[BaseException] = []

    def closer(event: Any) -> None:
        if event.kind is EventKind.SLEEP_REQUESTED:
            try:
                ctrl.close()
            except CommandInFlight as exc:
                seen.append(exc)

    ctrl.subscribe(closer)
    ctrl.sleep(1)
    assert len(seen) == 1
    assert ctrl.state is State.ASLEEP_L1
    ctrl.close()
    with pytest.raises(ControllerClosed):
        ctrl.wake()


def test_not_recovered_names_the_log_failure(tmp_path: Path) -> None:
    """When a rollback cannot be recorded the controller refuses with NotRecovered naming why, until recover()."""
    memory = FakeMemory(TAGS)
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(memory, EventLog(path, fsync=False))
    disk_full = _fill_disk_at(ctrl, path, EventKind.TAG_RELEASED, "weights")
    with pytest.raises(LogWriteFailed, match="No space left"):
        ctrl.sleep(1)
    assert ctrl.state is State.SUSPENDING  # what the log says; the memory was rolled back
    assert all(memory.content(t) is not None for t in TAGS)
    with pytest.raises(NotRecovered, match="rollback could not be recorded"):
        ctrl.wake()
    disk_full[0] = False
    assert ctrl.recover().state is State.AWAKE
    ctrl.sleep(1)
    ctrl.wake()
    assert replay(path).to_dict() == ctrl.projection.to_dict()


def replay_events(path: Path) -> list[Any]:
    """Every event of the log at ``path``."""
    from torpor.statemachine.log.reader import read_events

    return list(read_events(path))


# -- a real SIGINT while the log is written ------------------------------------------------------

#: One cycle of commands; each cell interrupts one of the log writes (or fsyncs) it makes.
CYCLE: tuple[tuple[str, Any], ...] = (
    ("sleep", 1),
    ("wake", ["weights"]),
    ("wake", None),
    ("sleep", 2),
    ("discard", ["weights"]),
    ("wake", None),
)


def _command(ctrl: SleepController, name: str, arg: Any) -> None:
    if name == "sleep":
        ctrl.sleep(arg)
    elif name == "wake":
        ctrl.wake(arg)
    else:
        ctrl.discard(arg)


def _cycle(ctrl: SleepController) -> int:
    """Run :data:`CYCLE`, going on past each Ctrl-C (as an engine loop that catches it does); the interrupts met."""
    interrupts = 0
    for name, arg in CYCLE:
        try:
            _command(ctrl, name, arg)
        except KeyboardInterrupt:
            interrupts += 1
        except TorporError:  # refused after an interrupt left a tag elsewhere than the cycle expects
            pass
    return interrupts


class _SigintAfter:
    """``os.write`` or ``os.fsync`` that, on the log's file, sends a real SIGINT once the ``nth`` call has returned.

    The handler (``KeyboardInterrupt``) then runs at the next instruction the
    interpreter checks for signals: after the system call completed, before its
    result is stored.
    """

    def __init__(self, name: str, nth: int) -> None:
        self.name = name
        self.real = getattr(os, name)
        self.nth = nth
        self.calls = 0
        self.fd: int | None = None

    def __call__(self, fd: int, *args: Any) -> Any:
        result = self.real(fd, *args)
        if fd == self.fd:
            self.calls += 1
            if self.calls == self.nth:
                signal.raise_signal(signal.SIGINT)
        return result


def _check_after_interrupt(ctrl: SleepController, path: Path, where: str) -> list[str]:
    """What is wrong after an interrupt: an unreadable log, a repeated number, a controller that disagrees or is stuck."""
    problems: list[str] = []
    try:
        seqs = [e.seq for e in replay_events(path)]
    except TorporError as exc:
        return [f"{where}: the log is unreadable: {exc}"]
    if seqs != list(range(1, len(seqs) + 1)):
        problems.append(f"{where}: sequence numbers {seqs}")
    if replay(path).to_dict() != ctrl.projection.to_dict():
        problems.append(f"{where}: the controller ({ctrl.state}) and the log ({replay(path).state}) disagree")
    if ctrl.state in TRANSITIONAL:
        problems.append(f"{where}: the controller is left in {ctrl.state.value}")
    return problems


@pytest.mark.parametrize(("call", "fsync"), [("write", False), ("write", True), ("fsync", True)])
def test_a_sigint_right_after_each_log_write_keeps_log_and_controller_consistent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], call: str, fsync: bool
) -> None:
    """A real SIGINT after each os.write (or fsync) of a cycle: no repeated number, the log reads (restart, log replay, status), the controller agrees and is not left mid-transition."""
    cells = support.count_log_calls(call, _SigintAfter(call, 0), _cycle, TAGS, fsync, tmp_path, monkeypatch)
    assert cells >= 8, f"a cycle makes only {cells} {call} calls on the log"
    problems: list[str] = []
    for nth in range(1, cells + 1):
        path = tmp_path / f"cell{nth}" / "default.rank0.jsonl"  # the name torpor status looks for
        ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=fsync))
        assert ctrl.log is not None
        inject = _SigintAfter(call, nth)
        inject.fd = ctrl.log._fd
        monkeypatch.setattr(os, call, inject)
        try:
            interrupts = _cycle(ctrl)
        finally:
            monkeypatch.setattr(os, call, inject.real)
        where = f"os.{call} #{nth}"
        assert interrupts == 1, f"{where}: the interrupt was {'swallowed' if not interrupts else 'repeated'}"
        problems += _check_after_interrupt(ctrl, path, where)
        try:
            if ctrl.projection.interrupted:
                ctrl.recover()
            if ctrl.state is not State.AWAKE:
                ctrl.wake()
            ctrl.sleep(1)
            ctrl.wake()
        except TorporError as exc:
            problems.append(f"{where}: the next cycle fails: {exc}")
        ctrl.close()
        try:  # a restarted engine reads the log
            SleepController(FakeMemory(TAGS), path).close()
        except TorporError as exc:
            problems.append(f"{where}: a restarted engine fails: {exc}")
        for argv in (["log", "replay", str(path)], ["status", str(path.parent)]):
            if main(argv) != 0:
                problems.append(f"{where}: torpor {' '.join(argv)} fails: {capsys.readouterr().err.strip()}")
        capsys.readouterr()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("fsync", [False, True], ids=["fsync-off", "fsync-on"])
def test_a_real_sigint_at_random_moments_never_breaks_the_log(tmp_path: Path, fsync: bool) -> None:
    """Real SIGINTs at random moments of sleep/wake cycles: after each, the log reads, numbers follow on, the controller agrees and is not stuck."""
    rng = random.Random(30)
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=fsync))
    problems: list[str] = []
    for round_ in range(40):
        timer = threading.Timer(rng.uniform(0.0, 0.002), os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            while True:  # until the interrupt: it lands somewhere in here
                try:
                    if ctrl.state is State.AWAKE:
                        ctrl.sleep(rng.choice([1, 2]))
                    elif rng.random() < 0.2:
                        ctrl.discard(["weights"])
                    else:
                        ctrl.wake(rng.choice([["weights"], None]))
                except TorporError:
                    pass
        except KeyboardInterrupt:
            pass
        timer.join()
        problems += _check_after_interrupt(ctrl, path, f"interrupt {round_ + 1}")
        if problems:
            break
    ctrl.close()
    assert not problems, "\n".join(problems)
    assert replay(path).state is ctrl.state


@pytest.mark.parametrize("fsync", [False, True], ids=["fsync-off", "fsync-on"])
def test_an_engine_that_catches_sigints_from_outside_leaves_a_log_every_reader_reads(
    tmp_path: Path, fsync: bool
) -> None:
    """SIGINTs sent to a cycling engine that catches them, then SIGKILL: the log reads, numbers follow on, a restart recovers."""
    path = tmp_path / "default.rank0.jsonl"
    argv = [sys.executable, str(WORKER), str(path), "7", str(64 << 20), "--catch-interrupts"]
    worker = subprocess.Popen([*argv, *([] if fsync else ["--no-fsync"])], stdout=subprocess.PIPE)
    rng = random.Random(27)
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == b"ready"
        for _ in range(40):
            time.sleep(rng.uniform(0.002, 0.008))
            worker.send_signal(signal.SIGINT)
        time.sleep(0.05)
        assert worker.poll() is None, "the engine died of an interrupt it catches"
    finally:
        worker.kill()
        worker.wait(30)
    seqs = [e.seq for e in replay_events(path)]
    assert seqs == list(range(1, len(seqs) + 1))
    restarted = SleepController(FakeMemory(TAGS), path)
    if restarted.projection.interrupted:  # killed mid-command: the usual way back
        restarted.recover()
    restarted.sleep(1)
    restarted.wake()
    restarted.close()
    assert main(["log", "replay", str(path)]) == 0
    assert main(["status", str(tmp_path)]) == 0
