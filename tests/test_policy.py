"""Tests for torpor.statemachine.core.policy: the default plan and the wake set."""

from __future__ import annotations

import pytest

from torpor.errors import InvalidLevel
from torpor.statemachine.core.policy import (
    DEFAULT_POLICY,
    Action,
    AfterWake,
    HostMemoryPolicy,
    PinWhen,
    Policy,
    parse_bytes,
)

TAGS = ["weights", "kv_cache", "cudagraph", "runtime", "workspace"]


def test_level1_offloads_weights_discards_kv_and_workspace() -> None:
    """Level 1 offloads weights and every other tag and discards kv_cache and workspace (as vLLM does)."""
    plan = DEFAULT_POLICY.plan(1, TAGS)
    assert plan == {
        "cudagraph": Action.OFFLOAD,
        "kv_cache": Action.DISCARD,
        "runtime": Action.OFFLOAD,
        "weights": Action.OFFLOAD,
        "workspace": Action.DISCARD,
    }


def test_level2_discards_weights_keeps_graphs() -> None:
    """Level 2 discards weights and kv_cache and still offloads cudagraph."""
    plan = DEFAULT_POLICY.plan(2, TAGS)
    assert plan["weights"] is Action.DISCARD
    assert plan["kv_cache"] is Action.DISCARD
    assert plan["workspace"] is Action.DISCARD
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


def test_host_policy_default_pins_at_sleep_keeps_after_wake_without_budget() -> None:
    """The default host-memory policy pins at the first sleep, keeps it after wake, and has no budget."""
    host = DEFAULT_POLICY.host_policy()
    assert (host.pin, host.after_wake, host.budget_bytes) == (PinWhen.AT_SLEEP, AfterWake.KEEP, None)


def test_host_policy_from_the_environment() -> None:
    """TORPOR_HOST_PIN, TORPOR_HOST_AFTER_WAKE and TORPOR_HOST_BUDGET set the host-memory policy."""
    env = {"TORPOR_HOST_PIN": "ahead", "TORPOR_HOST_AFTER_WAKE": "release", "TORPOR_HOST_BUDGET": "1.5GiB"}
    host = HostMemoryPolicy.from_env(env)
    assert host == HostMemoryPolicy(PinWhen.AHEAD, AfterWake.RELEASE, 3 << 29)
    assert host.to_dict() == {"pin": "ahead", "after_wake": "release", "budget_bytes": 3 << 29}


@pytest.mark.parametrize("env", [{"TORPOR_HOST_PIN": "early"}, {"TORPOR_HOST_BUDGET": "lots"}])
def test_bad_host_settings_name_the_variables(env: dict[str, str]) -> None:
    """A malformed TORPOR_HOST_* value raises ValueError naming the variables and what they take."""
    with pytest.raises(ValueError, match="TORPOR_HOST_PIN"):
        HostMemoryPolicy.from_env(env)


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [("4096", 4096), ("64GiB", 64 << 30), ("64G", 64 << 30), ("512 MiB", 512 << 20), ("1.5t", 3 << 39)],
)
def test_parse_bytes_reads_binary_units(text: str, nbytes: int) -> None:
    """Byte sizes are read with binary units, with or without iB."""
    assert parse_bytes(text) == nbytes


def test_negative_budget_is_refused() -> None:
    """A budget below zero is rejected when the policy is built."""
    with pytest.raises(ValueError, match="budget_bytes"):
        HostMemoryPolicy(budget_bytes=-1)


def test_tags_discarded_at_every_level_are_never_backed_up() -> None:
    """never_backed_up() names the tags every level discards (kv_cache, workspace by default), not a tag one level offloads."""
    assert DEFAULT_POLICY.never_backed_up() == {"kv_cache", "workspace"}
    offloading_kv = Policy(
        levels={1: {"kv_cache": Action.OFFLOAD}, 2: {"kv_cache": Action.DISCARD, "x": Action.DISCARD}}
    )
    assert offloading_kv.never_backed_up() == frozenset()
    assert Policy(levels={}).never_backed_up() == frozenset()


def test_the_tag_vocabulary_is_the_policy_s() -> None:
    """The named tags are the strings the default policy and the deferrable set use."""
    from torpor.statemachine.core import policy

    named = [policy.WEIGHTS, policy.KV_CACHE, policy.CUDAGRAPH, policy.RUNTIME, policy.WORKSPACE]
    assert named == TAGS and policy.DEFAULT_TAG == "default"
    assert {policy.WEIGHTS, policy.KV_CACHE} == policy.DEFERRABLE and {policy.CUDAGRAPH} == policy.NEVER_DISCARD
