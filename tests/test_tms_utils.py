"""torpor.tms.utils: torch_memory_saver.utils's names that TMS's test suite imports."""

from __future__ import annotations

import os

import pytest

from torpor.tms.utils import change_env, is_xpu


def test_change_env_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """change_env sets the variable inside and restores the old value, or its absence, after."""
    monkeypatch.setenv("TORPOR_T_OLD", "a")
    monkeypatch.delenv("TORPOR_T_NEW", raising=False)
    with change_env("TORPOR_T_OLD", "b"), change_env("TORPOR_T_NEW", "1"):
        assert (os.environ["TORPOR_T_OLD"], os.environ["TORPOR_T_NEW"]) == ("b", "1")
    assert os.environ["TORPOR_T_OLD"] == "a" and "TORPOR_T_NEW" not in os.environ


def test_is_xpu_is_false() -> None:
    """torpor runs on CUDA only."""
    assert is_xpu() is False
