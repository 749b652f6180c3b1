"""Tests of torpor.hooks.allreduce: whether custom all-reduce may IPC-register graph buffers."""

from __future__ import annotations

import pytest

from torpor.hooks import cudagraph_pool_decision, register_graph_buffers, reset_warnings
from torpor.statemachine import EventKind, SleepController
from torpor.testing import FakeMemory, capture_events


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    reset_warnings()


def test_active_pool_refuses_registration() -> None:
    """With the cuMem graph pool active, graph buffers are not IPC-registered."""
    assert register_graph_buffers(cudagraph_pool_decision(True, True, "cumem", True, "cuda")) is False


@pytest.mark.parametrize(
    "args",
    [(False, True, "cumem", True, "cuda"), (True, True, "cumem", False, "cuda"), (True, True, "x", True, "cuda")],
)
def test_inactive_pool_keeps_registration(args: tuple[bool, bool, str, bool, str]) -> None:
    """Whenever the pool is inactive (opted out or a requirement unmet), graph buffers stay registered."""
    assert register_graph_buffers(cudagraph_pool_decision(*args)) is True


def test_answer_is_recorded_on_a_controller() -> None:
    """With a controller the answer is a hook_decision event naming the reason."""
    controller = SleepController(FakeMemory({"weights": 10}))
    with capture_events(controller, [EventKind.HOOK_DECISION]) as events:
        register_graph_buffers(cudagraph_pool_decision(True, True, "torpor", True, "cuda"), controller=controller)
    assert len(events) == 1
    assert events[0].data["hook"] == "custom_allreduce"
    assert events[0].data["active"] is True
    assert "cudaIpcGetMemHandle" in events[0].data["detail"]
