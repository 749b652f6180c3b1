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
    """torpor bench on a machine without CUDA exits 1 (cannot run here; docs/cli.md) with a one-line reason."""
    from torpor.commands import bench

    assert bench.run(argparse.Namespace(out=None, cycles=1, no_sweep=True, no_tms=True)) == 1


def test_no_allocator_module_imports_the_controller_or_the_bench() -> None:
    """The mechanism imports neither the controller nor the benchmark harness that drives it (torpor.bench)."""
    import ast
    from pathlib import Path

    import torpor.allocator

    offenders = []
    for path in sorted(Path(torpor.allocator.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name == "torpor" or name.startswith(("torpor.statemachine.machine.controller", "torpor.bench")):
                    offenders.append(f"{path.name}: {name}")
    assert offenders == []
