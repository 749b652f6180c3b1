"""UNINTERRUPTED: Python signal handlers held back around a step, run right after it."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import pytest

from torpor.statemachine.log.interrupts import UNINTERRUPTED


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
