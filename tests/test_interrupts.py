"""UNINTERRUPTED: Python signal handlers held back around a step, run right after it."""

from __future__ import annotations

import os
import random
import signal
import threading
from pathlib import Path
from types import FrameType

import pytest

from torpor.errors import TorporError
from torpor.statemachine.core.states import TRANSITIONAL, State
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.interrupts import UNINTERRUPTED
from torpor.statemachine.log.reader import read_events, replay
from torpor.statemachine.machine.controller import SleepController
from torpor.testing import FakeMemory


def test_a_sigint_inside_the_block_is_raised_when_it_ends() -> None:
    """A SIGINT inside the block lets the block finish, then raises KeyboardInterrupt."""
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), UNINTERRUPTED:
        signal.raise_signal(signal.SIGINT)
        done.append("after the signal")
        done.append("to the end")
    assert done == ["after the signal", "to the end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_blocks_raise_at_the_outermost_end() -> None:
    """A signal inside a nested block is held until the outermost block ends."""
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), UNINTERRUPTED:
        with UNINTERRUPTED:
            signal.raise_signal(signal.SIGINT)
        done.append("the outer block goes on")
    assert done == ["the outer block goes on"]
    assert not UNINTERRUPTED.active


def test_any_python_handler_is_held_and_called_once_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """A custom SIGTERM handler (vLLM's raises SystemExit) runs once, after the block, and stays installed."""
    calls: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with UNINTERRUPTED:
            signal.raise_signal(signal.SIGTERM)
            held = list(calls)
        assert held == [] and calls == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_ignored_signal_is_left_alone() -> None:
    """A SIG_IGN handler is not replaced: the signal stays ignored inside and after the block."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with UNINTERRUPTED:
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_outside_the_main_thread_the_block_changes_nothing() -> None:
    """In another thread (where no Python handler runs) the block touches no handler."""
    seen: list[object] = []

    def body() -> None:
        with UNINTERRUPTED:
            seen.append(signal.getsignal(signal.SIGINT))
            seen.append(UNINTERRUPTED.active)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(10)
    assert seen == [signal.default_int_handler, False]


def test_a_handler_installed_inside_the_block_stays() -> None:
    """A SIGINT handler installed by someone inside the block is left in place when the block ends."""
    calls: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)

    try:
        with UNINTERRUPTED:
            signal.signal(signal.SIGINT, handler)
        assert signal.getsignal(signal.SIGINT) is handler
        signal.raise_signal(signal.SIGINT)
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# -- any raising handler (a watchdog, SIGUSR1, SIGHUP) at a random moment of a sleep and a wake ---------------

TAGS = {"weights": 4096, "kv_cache": 8192, "runtime": 1024}


class Watchdog(Exception):
    """What a raising signal handler raises (a step watchdog's timeout)."""


#: How many times the handler ran (a round ends once it did, even where a guard logged and dropped the exception).
_FIRED = [0]


def _raise_watchdog(signum: int, frame: FrameType | None) -> None:
    _FIRED[0] += 1
    msg = f"signal {signum}: step timed out"
    raise Watchdog(msg)


def _send_later(sig: int, delay: float) -> threading.Timer | None:
    """Arrange ``sig`` in ``delay`` seconds: SIGALRM from a real interval timer, the others from another thread."""
    if sig == signal.SIGALRM:
        signal.setitimer(signal.ITIMER_REAL, max(delay, 1e-6))
        return None
    timer = threading.Timer(delay, os.kill, (os.getpid(), sig))
    timer.start()
    return timer


def _until_signalled(ctrl: SleepController, rng: random.Random, fired: int) -> None:
    """Sleep and wake until the handler has run again (``fired``: its count before); refusals are passed over."""
    while _FIRED[0] == fired:
        try:
            if ctrl.state is State.AWAKE:
                ctrl.sleep(rng.choice([1, 2]))
            else:
                ctrl.wake(rng.choice([["weights"], None]))
        except TorporError:
            pass


# A handler that fires inside a garbage collector's weakref callback has its exception printed and dropped by Python.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("fsync", [False, True], ids=["fsync-off", "fsync-on"])
@pytest.mark.parametrize("sig", [signal.SIGALRM, signal.SIGUSR1, signal.SIGHUP], ids=lambda s: s.name)
def test_a_raising_handler_of_any_signal_at_random_moments_never_breaks_log_or_controller(
    tmp_path: Path, sig: signal.Signals, fsync: bool
) -> None:
    """300 real signals whose handler raises, at random moments of sleeps and wakes: the log reads, numbers follow on, the controller agrees and every later command works."""
    rng = random.Random(37 + sig)
    path = tmp_path / "e.jsonl"
    previous = signal.signal(sig, _raise_watchdog)
    ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=fsync, max_bytes=256 << 10))
    problems: list[str] = []
    try:
        for round_ in range(300):
            timer, fired = None, _FIRED[0]
            try:  # the signal may come before the timer is stored: it fired, and there is nothing to wait for
                timer = _send_later(sig, rng.uniform(0.0, 0.004 if fsync else 0.001))
                _until_signalled(ctrl, rng, fired)
            except Watchdog:
                pass
            except Exception as exc:
                problems.append(f"round {round_ + 1}: {type(exc).__name__}: {exc}")
            if timer is not None:
                timer.join()
            assert ctrl.log is not None
            if ctrl.log.last_seq != ctrl.last_seq:
                problems.append(
                    f"round {round_ + 1}: the log is at #{ctrl.log.last_seq}, the controller at #{ctrl.last_seq}"
                )
            if ctrl.state in TRANSITIONAL:
                problems.append(f"round {round_ + 1}: the controller is left in {ctrl.state.value}")
            if problems:
                break
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(sig, previous)
    try:
        seqs = [e.seq for e in read_events(path)]
        if seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            problems.append("the log's sequence numbers do not follow on")
        if replay(path).to_dict() != ctrl.projection.to_dict():
            problems.append(f"the log ({replay(path).state}) and the controller ({ctrl.state}) disagree")
        ctrl.close()
        SleepController(FakeMemory(TAGS), path).close()  # a restarted engine reads it
    except (TorporError, ValueError) as exc:
        problems.append(f"after the rounds: {type(exc).__name__}: {exc}")
    assert not problems, "\n".join(problems[:5])
