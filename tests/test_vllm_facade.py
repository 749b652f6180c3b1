"""Tests of torpor.hooks.vllm.facade on the simulated device: the defaults a vLLM worker's controller starts with."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor import SleepController
from torpor.allocator import SimDriver, TaggedAllocator
from torpor.hooks.vllm.facade import TorporMemAllocator
from torpor.statemachine.core.policy import PinWhen
from torpor.units import MiB


def _facade(tmp_path: Path) -> TorporMemAllocator:
    """A facade over a small simulated device, engine and rank given (no vLLM needed)."""
    memory = TaggedAllocator(SimDriver(capacity=64 * MiB, granularity=64 << 10))
    return TorporMemAllocator(memory, log_dir=tmp_path / "logs", engine="facade-test", rank=0, fsync=False)


def _loaded(tmp_path: Path, **tags: int) -> tuple[TorporMemAllocator, dict[str, int]]:
    """A facade with one allocation of the given bytes in each tag, made as vLLM makes them; their addresses."""
    facade = _facade(tmp_path)
    made = {}
    for tag, nbytes in tags.items():
        with facade.use_memory_pool(tag):
            made[tag] = facade.memory.allocate(nbytes)
    return facade, made


def test_under_vllm_host_memory_is_pinned_ahead_by_default_once_the_weights_are_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With TORPOR_HOST_PIN unset a vLLM worker pins ahead: the weights' host memory is pinned before the first sleep."""
    monkeypatch.delenv("TORPOR_HOST_PIN", raising=False)
    facade, _ = _loaded(tmp_path, weights=8 * MiB)
    assert facade.controller.host_policy.pin is PinWhen.AHEAD
    assert facade.memory.wait_host_ready(30)
    assert facade.memory.pinned_bytes() >= 8 * MiB
    facade.release_pools()


def test_under_vllm_the_operator_opts_out_of_pinning_ahead_with_at_sleep(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORPOR_HOST_PIN=at_sleep keeps a vLLM worker from pinning ahead: nothing is pinned before the first sleep."""
    monkeypatch.setenv("TORPOR_HOST_PIN", "at_sleep")
    facade, _ = _loaded(tmp_path, weights=8 * MiB)
    assert facade.controller.host_policy.pin is PinWhen.AT_SLEEP
    assert facade.memory.pinned_bytes() == 0
    facade.release_pools()


def test_plain_pytorch_keeps_pinning_at_sleep_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SleepController outside vLLM with TORPOR_HOST_PIN unset pins at sleep (docs/allocator.md says why)."""
    monkeypatch.delenv("TORPOR_HOST_PIN", raising=False)
    memory = TaggedAllocator(SimDriver(capacity=16 * MiB, granularity=64 << 10))
    assert SleepController(memory).host_policy.pin is PinWhen.AT_SLEEP


def test_under_vllm_a_sleep_releases_the_kv_cache_before_it_backs_up_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With TORPOR_DISCARD_FIRST unset a vLLM worker's level-1 sleep releases kv_cache first, and the weights come back."""
    monkeypatch.delenv("TORPOR_DISCARD_FIRST", raising=False)
    monkeypatch.setenv("TORPOR_HOST_PIN", "at_sleep")
    facade, made = _loaded(tmp_path, weights=4 * MiB, kv_cache=8 * MiB)
    weights = made["weights"]
    facade.memory.write(weights, b"w" * 4096)
    ctl = facade.controller
    assert ctl.policy.discard_first is True
    facade.sleep(offload_tags=("weights",))
    order = [(e.kind.value, e.data["tag"]) for e in ctl.events() if e.kind.value in ("tag_released", "tag_backed_up")]
    assert order[0] == ("tag_released", "kv_cache")
    assert order.index(("tag_released", "kv_cache")) < order.index(("tag_backed_up", "weights"))
    facade.wake_up()
    assert facade.memory.read(weights, 4096) == b"w" * 4096
    facade.release_pools()


def test_under_vllm_torpor_discard_first_0_keeps_the_offloaded_first_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORPOR_DISCARD_FIRST=0 makes a vLLM worker release its offloaded tags before the KV cache; a bad value is refused."""
    monkeypatch.setenv("TORPOR_DISCARD_FIRST", "0")
    facade = _facade(tmp_path)
    assert facade.controller.policy.discard_first is False
    facade.release_pools()
    monkeypatch.setenv("TORPOR_DISCARD_FIRST", "maybe")
    with pytest.raises(ValueError, match="TORPOR_DISCARD_FIRST='maybe' is not a switch"):
        _ = _facade(tmp_path / "bad").controller
