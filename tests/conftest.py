"""Shared pytest setup: GPU tests skip themselves where CUDA (or a second GPU) is absent; hypothesis profiles; the ``make_rig`` fixture.

Hypothesis explores new random examples on every run by default, which is how
bugs are found. ``TORPOR_HYPOTHESIS=ci`` (set by ``.ci/run``) derandomizes
it, so that CI tests the same examples each time and a landing never depends
on the luck of a draw; bugs found locally become unit tests.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

if TYPE_CHECKING:
    from support import RigMaker

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("TORPOR_HYPOTHESIS", "explore"))


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


@pytest.fixture
def make_rig() -> Iterator[RigMaker]:
    """``make_rig(preset, **changes)``: a ``torpor.testrig.SimRig`` of a preset of ``support.RIG_PRESETS``, closed when the test ends."""
    from support import RigMaker  # here: collecting a test that builds no rig imports no allocator

    maker = RigMaker()
    yield maker
    maker.close()
