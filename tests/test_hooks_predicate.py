"""Tests of torpor.hooks.predicate: the shared cuMem graph-pool predicate."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from torpor.hooks import CUMEM_BACKENDS, REQUIREMENTS, cudagraph_pool_decision, detect_platform, reset_warnings
from torpor.statemachine import EventKind, SleepController
from torpor.testing import FakeMemory, capture_events

ON = {"offload_cudagraph": True, "sleep_mode": True, "backend": "torpor", "cudagraphs": True, "platform": "cuda"}

#: One way to break each requirement other than the opt-in.
BREAK = {
    "sleep_mode": {"sleep_mode": False},
    "cumem_backend": {"backend": "custom"},
    "cudagraphs": {"cudagraphs": False},
    "cuda_platform": {"platform": "rocm"},
}


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    reset_warnings()
    yield
    reset_warnings()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "torpor.hooks" and r.levelno == logging.WARNING]


def test_all_requirements_met_is_active(caplog: pytest.LogCaptureFixture) -> None:
    """With every requirement met the pool is active, nothing is missing and nothing is logged."""
    decision = cudagraph_pool_decision(**ON)
    assert decision.active
    assert decision.missing == ()
    assert decision.opted_in
    assert _warnings(caplog) == []
    assert "active" in decision.describe()


@pytest.mark.parametrize("backend", [*sorted(CUMEM_BACKENDS), "CuMem", " torpor "])
def test_cumem_family_backends_are_accepted(backend: str) -> None:
    """Both cuMem-family backends (any case, stray spaces) make the pool active."""
    assert cudagraph_pool_decision(**{**ON, "backend": backend}).active


@pytest.mark.parametrize("requirement", sorted(BREAK))
def test_each_missing_requirement_is_named(requirement: str, caplog: pytest.LogCaptureFixture) -> None:
    """Breaking one requirement makes the pool inactive, names exactly it, and warns once naming it."""
    decision = cudagraph_pool_decision(**{**ON, **BREAK[requirement]})
    assert not decision.active
    assert decision.missing == (requirement,)
    assert len(decision.reasons) == 1
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert requirement in warnings[0]
    assert requirement in decision.describe()


def test_missing_requirements_keep_their_order() -> None:
    """Several unmet requirements are reported in REQUIREMENTS order."""
    decision = cudagraph_pool_decision(True, False, None, False, "cpu")
    assert decision.missing == ("sleep_mode", "cumem_backend", "cudagraphs", "cuda_platform")
    assert list(decision.missing) == [r for r in REQUIREMENTS if r in decision.missing]


def test_opted_in_inactive_warns_once_across_call_sites(caplog: pytest.LogCaptureFixture) -> None:
    """The same inactive configuration asked from many call sites gives exactly one warning."""
    for _ in range(5):
        assert not cudagraph_pool_decision(**{**ON, "backend": "cumem-v2"}).active
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "'cumem-v2'" in warnings[0]


def test_not_opted_in_is_silent(caplog: pytest.LogCaptureFixture) -> None:
    """Not opted in: inactive, the opt-in is reported missing, and no warning is logged."""
    caplog.set_level(logging.DEBUG)
    decision = cudagraph_pool_decision(False, False, None, False, "cpu")
    assert not decision.active
    assert not decision.opted_in
    assert decision.missing[0] == "offload_cudagraph"
    assert _warnings(caplog) == []


def test_reset_warnings_allows_a_new_warning(caplog: pytest.LogCaptureFixture) -> None:
    """After reset_warnings the same configuration warns again."""
    cudagraph_pool_decision(**{**ON, "cudagraphs": False})
    reset_warnings()
    cudagraph_pool_decision(**{**ON, "cudagraphs": False})
    assert len(_warnings(caplog)) == 2


def test_decision_is_recorded_on_a_controller() -> None:
    """With a controller the decision becomes a hook_decision event carrying active and the detail."""
    controller = SleepController(FakeMemory({"weights": 10}))
    with capture_events(controller, [EventKind.HOOK_DECISION]) as events:
        cudagraph_pool_decision(**{**ON, "sleep_mode": False}, controller=controller)
        cudagraph_pool_decision(**ON, controller=controller)
    assert [e.data["hook"] for e in events] == ["cudagraph_pool", "cudagraph_pool"]
    assert [e.data["active"] for e in events] == [False, True]
    assert "sleep_mode" in events[0].data["detail"]


def test_detect_platform_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """detect_platform says cpu where torch sees no CUDA device and cuda where it does."""
    import torch

    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detect_platform() == "cpu"
    monkeypatch.setattr(torch.version, "cuda", "13.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert detect_platform() == "cuda"
    monkeypatch.setattr(torch.version, "hip", "7.0", raising=False)
    assert detect_platform() == "rocm"


def test_platform_none_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """platform=None asks detect_platform (here: no CUDA, so cuda_platform is missing)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    decision = cudagraph_pool_decision(True, True, "torpor", True, None)
    assert decision.missing == ("cuda_platform",)
    assert decision.platform == "cpu"
