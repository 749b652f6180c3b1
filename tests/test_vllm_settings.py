"""Tests of torpor.hooks.vllm.settings: what a vLLM worker's controller starts with, read from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.allocator import SimDriver, TaggedAllocator
from torpor.hooks.vllm.facade import TorporMemAllocator
from torpor.hooks.vllm.settings import ENV_LOG_FSYNC, worker_discard_first, worker_host_policy, worker_rank
from torpor.statemachine.core.policy import PinWhen
from torpor.units import MiB


def test_log_fsync_follows_torpor_log_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORPOR_LOG_FSYNC=0 makes the worker's log skip fsync (default on); a value that is no switch is refused."""

    def log_fsync(name: str) -> bool:
        allocator = TorporMemAllocator(
            TaggedAllocator(SimDriver(capacity=16 * MiB)), log_dir=tmp_path / name, engine=name, rank=0
        )
        try:
            log = allocator.controller.log
            assert log is not None
            return log.fsync
        finally:
            allocator.release_pools()

    monkeypatch.delenv(ENV_LOG_FSYNC, raising=False)
    assert log_fsync("default") is True
    monkeypatch.setenv(ENV_LOG_FSYNC, "0")
    assert log_fsync("off") is False
    monkeypatch.setenv(ENV_LOG_FSYNC, "1")
    assert log_fsync("on") is True
    monkeypatch.setenv(ENV_LOG_FSYNC, "sometimes")
    with pytest.raises(ValueError, match="TORPOR_LOG_FSYNC"):
        log_fsync("bad")


@pytest.mark.parametrize(
    ("value", "expected"), [(None, True), ("", True), ("1", True), ("on", True), ("0", False), ("off", False)]
)
def test_worker_discard_first_is_on_unless_switched_off(value: str | None, expected: bool) -> None:
    """TORPOR_DISCARD_FIRST unset, empty or on releases the KV cache first; 0/off keeps the offloaded-first order."""
    environ = {} if value is None else {"TORPOR_DISCARD_FIRST": value}
    assert worker_discard_first(environ) is expected


def test_worker_discard_first_refuses_a_value_that_is_no_switch() -> None:
    """A TORPOR_DISCARD_FIRST that is no switch is refused, naming the variable and its value."""
    with pytest.raises(ValueError, match="TORPOR_DISCARD_FIRST='later' is not a switch"):
        worker_discard_first({"TORPOR_DISCARD_FIRST": "later"})


def test_worker_host_policy_pins_ahead_unless_told() -> None:
    """A vLLM worker pins ahead with TORPOR_HOST_PIN unset or empty, at the sleep when it says at_sleep."""
    assert worker_host_policy({}).pin is PinWhen.AHEAD
    assert worker_host_policy({"TORPOR_HOST_PIN": " "}).pin is PinWhen.AHEAD
    assert worker_host_policy({"TORPOR_HOST_PIN": "at_sleep"}).pin is PinWhen.AT_SLEEP


@pytest.mark.parametrize(
    ("name", "value"), [("RANK", "-1"), ("RANK", "²"), ("TORPOR_RANK", "-2"), ("TORPOR_RANK", "x")]
)
def test_worker_rank_refuses_a_rank_that_is_no_whole_number(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A negative or non-decimal RANK or TORPOR_RANK is refused naming the variable, as torpor.tms reads it."""
    monkeypatch.delenv("TORPOR_RANK", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name}=.* is not a rank"):
        worker_rank()


@pytest.mark.parametrize(("value", "expected"), [(" 1", 1), ("1 ", 1), ("+1", 1), ("", 0)])
def test_worker_rank_reads_rank_as_torpor_tms_does(value: str, expected: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK with spaces around or a plus sign is that rank; blank is 0."""
    monkeypatch.delenv("TORPOR_RANK", raising=False)
    monkeypatch.setenv("RANK", value)
    assert worker_rank() == expected
