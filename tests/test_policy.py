"""Tests for torpor.statemachine.policy: the default plan and the wake set."""

from __future__ import annotations

import pytest

from torpor.errors import InvalidLevel
from torpor.statemachine.policy import DEFAULT_POLICY, Action, Policy

TAGS = ["weights", "kv_cache", "cudagraph", "runtime", "workspace"]


def test_level1_offloads_weights_discards_kv() -> None:
    """Level 1 offloads weights and every non-deferrable tag and discards kv_cache."""
    plan = DEFAULT_POLICY.plan(1, TAGS)
    assert plan == {
        "cudagraph": Action.OFFLOAD,
        "kv_cache": Action.DISCARD,
        "runtime": Action.OFFLOAD,
        "weights": Action.OFFLOAD,
        "workspace": Action.OFFLOAD,
    }


def test_level2_discards_weights_keeps_graphs() -> None:
    """Level 2 discards weights and kv_cache and still offloads cudagraph."""
    plan = DEFAULT_POLICY.plan(2, TAGS)
    assert plan["weights"] is Action.DISCARD
    assert plan["kv_cache"] is Action.DISCARD
    assert plan["cudagraph"] is Action.OFFLOAD


@pytest.mark.parametrize("level", [0, 3, -1])
def test_bad_level_is_refused(level: int) -> None:
    """A level outside 1..2 raises InvalidLevel naming it."""
    with pytest.raises(InvalidLevel, match=str(level)):
        DEFAULT_POLICY.plan(level, TAGS)


def test_policy_refuses_to_discard_cudagraph() -> None:
    """A policy that discards cudagraph is rejected when built."""
    with pytest.raises(ValueError, match="cudagraph"):
        Policy(levels={1: {"cudagraph": Action.DISCARD}})


def test_selective_wake_restores_nondeferrable() -> None:
    """A wake naming weights restores weights and every non-deferrable tag, not kv_cache."""
    assert DEFAULT_POLICY.wake_set(["weights"], TAGS) == ["cudagraph", "runtime", "weights", "workspace"]


def test_full_wake_restores_everything() -> None:
    """A wake naming nothing restores every asleep tag."""
    assert DEFAULT_POLICY.wake_set(None, ["kv_cache", "weights"]) == ["kv_cache", "weights"]
