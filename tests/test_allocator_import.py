"""Tests that the allocator package loads without a GPU and that its GPU-only parts fail politely."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from torpor.allocator import CudaDriver, Driver


def test_import_touches_neither_torch_nor_cuda() -> None:
    """import torpor.allocator loads neither torch nor cuda-bindings (a machine without a GPU can import torpor)."""
    code = "import sys, torpor, torpor.allocator; print('torch' in sys.modules, 'cuda.bindings' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "False"]


def test_cuda_driver_is_lazy() -> None:
    """CudaDriver() makes no driver call; it is a Driver with the same call names."""
    driver = CudaDriver()
    assert isinstance(driver, Driver)
    assert driver.CALLS == Driver.CALLS
    assert not driver._ready


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_without_cuda_says_so() -> None:
    """torpor bench on a machine without CUDA exits 2 with a one-line reason."""
    from torpor.commands import bench

    assert bench.run(argparse.Namespace(out=None, cycles=1, no_sweep=True, no_tms=True)) == 2


def test_benchmark_rows_compute_ratios_to_the_floor() -> None:
    """A benchmark result row divides each time by bytes over the measured bandwidth."""
    from torpor.allocator.benchmark import Result, markdown

    r = Result("torpor", "w", 10**9, 4, sleeps=[2.0, 1.0, 1.0], wakes=[1.5, 1.5, 1.5], released=[10**9])
    row = r.row(1e9, 1e9)
    assert (row["first_x"], row["later_x"], row["wake_x"]) == (2.0, 1.0, 1.5)
    assert row["released_pct"] == 100.0
    assert "| torpor | w | 2.000 s (2.00x)" in markdown({"rows": [row]})
