"""Shared pytest setup: GPU tests skip themselves where CUDA (or a second GPU) is absent."""

from __future__ import annotations

import functools
import os
import shutil

import pytest


@functools.cache
def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip gpu/gpu2 tests without enough GPUs, prometheus tests without the server."""
    need_prom = os.environ.get("TORPOR_REQUIRE_PROMETHEUS") == "1"
    have_prom = shutil.which("prometheus") is not None and shutil.which("promtool") is not None
    for item in items:
        if "gpu2" in item.keywords and _cuda_devices() < 2:
            item.add_marker(pytest.mark.skip(reason="needs two CUDA GPUs"))
        elif "gpu" in item.keywords and _cuda_devices() < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "prometheus" in item.keywords and not have_prom and not need_prom:
            item.add_marker(pytest.mark.skip(reason="prometheus/promtool not on PATH (apt-get install prometheus)"))
