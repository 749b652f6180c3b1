"""Tests of torpor.hooks.nccl: the NCCL_GRAPH_REGISTER default under the cuMem graph pool."""

from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Iterator

import pytest

from torpor.hooks import NCCL_GRAPH_REGISTER, apply_nccl_defaults, cudagraph_pool_decision, reset_warnings
from torpor.statemachine import EventKind, SleepController
from torpor.testing import FakeMemory, capture_events


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    reset_warnings()
    yield
    reset_warnings()


ACTIVE = cudagraph_pool_decision(True, True, "torpor", True, "cuda")
INACTIVE = cudagraph_pool_decision(False, True, "torpor", True, "cuda")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "torpor.hooks" and r.levelno == logging.WARNING]


def test_active_and_unset_sets_zero(caplog: pytest.LogCaptureFixture) -> None:
    """Active pool and the variable unset: it is set to 0, quietly."""
    env: dict[str, str] = {"OTHER": "x"}
    result = apply_nccl_defaults(ACTIVE, env)
    assert env == {"OTHER": "x", NCCL_GRAPH_REGISTER: "0"}
    assert (result.action, result.value, result.safe) == ("set", "0", True)
    assert _warnings(caplog) == []


def test_empty_value_counts_as_unset() -> None:
    """An empty NCCL_GRAPH_REGISTER is treated as unset and replaced by 0."""
    env = {NCCL_GRAPH_REGISTER: ""}
    assert apply_nccl_defaults(ACTIVE, env).action == "set"
    assert env[NCCL_GRAPH_REGISTER] == "0"


def test_explicit_one_is_kept_with_a_warning_saying_why(caplog: pytest.LogCaptureFixture) -> None:
    """An explicit NCCL_GRAPH_REGISTER=1 is kept, with one warning citing the stale-registration bugs."""
    env = {NCCL_GRAPH_REGISTER: "1"}
    result = apply_nccl_defaults(ACTIVE, env)
    apply_nccl_defaults(ACTIVE, env)
    assert env == {NCCL_GRAPH_REGISTER: "1"}
    assert (result.action, result.value, result.safe) == ("kept", "1", False)
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    for needle in ("NCCL_GRAPH_REGISTER=1", "dangerous", "old physical pages", "torch_memory_saver#88", "sglang#40648"):
        assert needle in warnings[0]


def test_explicit_zero_is_kept_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """An explicit 0 is what torpor would set: kept, no warning."""
    env = {NCCL_GRAPH_REGISTER: "0"}
    result = apply_nccl_defaults(ACTIVE, env)
    assert (result.action, result.safe) == ("kept", True)
    assert env == {NCCL_GRAPH_REGISTER: "0"}
    assert _warnings(caplog) == []


@pytest.mark.parametrize("start", [{}, {NCCL_GRAPH_REGISTER: "1"}, {NCCL_GRAPH_REGISTER: "0"}])
def test_inactive_leaves_the_environment_untouched(start: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    """With the pool inactive the environment is not changed and nothing is logged."""
    caplog.set_level(logging.DEBUG)
    env = dict(start)
    result = apply_nccl_defaults(INACTIVE, env)
    assert env == start
    assert result.action == "untouched"
    assert result.value == start.get(NCCL_GRAPH_REGISTER)
    assert _warnings(caplog) == []


def test_default_environ_is_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without an environ argument the process environment (what workers inherit) is changed."""
    monkeypatch.setenv(NCCL_GRAPH_REGISTER, "placeholder")
    monkeypatch.delenv(NCCL_GRAPH_REGISTER)
    apply_nccl_defaults(ACTIVE)
    assert os.environ[NCCL_GRAPH_REGISTER] == "0"


def test_each_decision_is_an_event() -> None:
    """With a controller every outcome (set, kept, untouched) is recorded as a hook_decision event."""
    controller = SleepController(FakeMemory({"weights": 10}))
    with capture_events(controller, [EventKind.HOOK_DECISION]) as events:
        apply_nccl_defaults(ACTIVE, {}, controller=controller)
        apply_nccl_defaults(ACTIVE, {NCCL_GRAPH_REGISTER: "1"}, controller=controller)
        apply_nccl_defaults(INACTIVE, {}, controller=controller)
    assert [e.data["hook"] for e in events] == ["nccl_graph_register"] * 3
    assert [e.data["active"] for e in events] == [True, True, False]
    assert "set NCCL_GRAPH_REGISTER=0" in events[0].data["detail"]
    assert "kept explicit NCCL_GRAPH_REGISTER=1" in events[1].data["detail"]
    assert "left unset" in events[2].data["detail"]


def test_setting_after_distributed_init_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Setting the default after torch.distributed is initialized warns that existing communicators ignore it."""
    fake = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True)
    monkeypatch.setitem(sys.modules, "torch.distributed", fake)
    result = apply_nccl_defaults(ACTIVE, {})
    assert result.action == "set"
    assert "late" in result.detail
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "before the first communicator" in warnings[0]
