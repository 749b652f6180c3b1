"""Tests for torpor.extras: without the cuda extra (no torch, no cuda-bindings) the core works and GPU features say what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torpor.errors import MissingExtra, TorporError
from torpor.extras import available, require

ROOT = Path(__file__).resolve().parent.parent

#: Runs the rest of a script with torch, cuda(-bindings) and vllm unimportable, as in `pip install torpor`.
BLOCK = textwrap.dedent(
    """
    import importlib.abc, sys
    BLOCKED = ("torch", "cuda", "vllm")
    class _Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _Block())
    for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
        del sys.modules[name]
    """
)


def _without_torch(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "no_torch.py"
    script.write_text(BLOCK + textwrap.dedent(body))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, check=False, cwd=tmp_path
    )


def test_require_returns_an_importable_module() -> None:
    """require() returns the module when it imports."""
    import json

    assert require("json", "a test") is json
    assert available("json")
    assert not available("torpor_no_such_module")


def test_require_names_the_extra_when_the_module_is_missing() -> None:
    """A missing module raises MissingExtra, an ImportError and a TorporError whose message says what to pip install."""
    with pytest.raises(MissingExtra) as exc:
        require("torpor_no_such_module", "the frobnicator")
    assert isinstance(exc.value, ImportError)
    assert isinstance(exc.value, TorporError)
    assert "the frobnicator needs torpor_no_such_module" in str(exc.value)
    assert "pip install '.[cuda]'" in str(exc.value) and "checkout" in str(exc.value)
    assert "'torpor[" not in str(exc.value)  # torpor is on no package index: that install fails


def test_core_works_without_torch(tmp_path: Path) -> None:
    """Without torch: import torpor, run a controller with telemetry, serve /metrics and /state, read the log, no torch loaded."""
    done = _without_torch(
        tmp_path,
        """
        import json, sys, urllib.request
        import torpor
        from torpor import SleepController, replay
        from torpor.telemetry import attach, serve, render_dashboard
        from torpor.testing import FakeMemory
        from torpor.hooks import fleet, follow
        import torpor.client  # an RL controller's client

        ctl = SleepController(FakeMemory({"weights": 1 << 20}), log="logs", engine="e", rank=0, fsync=False)
        telemetry = attach(ctl)
        with serve(ctl, 0) as server:
            ctl.sleep(1)
            ctl.wake()
            metrics = urllib.request.urlopen(server.url.rstrip("/") + "/metrics").read().decode()
            state = json.loads(urllib.request.urlopen(server.url.rstrip("/") + "/state").read())
        telemetry.detach()
        assert 'torpor_state' in metrics, metrics
        assert state["state"] == "awake", state
        assert replay("logs/e.rank0.jsonl").state.value == "awake"
        assert fleet("logs").engines[0].state == "awake"
        assert json.loads(render_dashboard())["uid"]
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cuda", "vllm"))
        assert not loaded, loaded
        print("ok")
        """,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok"


def test_cli_without_torch(tmp_path: Path) -> None:
    """Without torch the CLI runs the simulated demo, log show, status; --device cuda and bench fail in one line naming the extra."""
    done = _without_torch(
        tmp_path,
        """
        import contextlib, io, sys
        from torpor.cli import main

        def run(*args):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(list(args))
            return rc, out.getvalue(), err.getvalue()

        rc, out, err = run("demo", "--cycles", "2", "--log-dir", "demo")
        assert rc == 0, (out, err)
        assert "on device 'sim' (torch is not installed; pip install '.[cuda]' from a torpor checkout" in out, out
        assert run("log", "show", "demo")[0] == 0
        assert run("log", "replay", "demo")[0] == 0
        assert run("status", "demo")[0] == 0
        assert run("diagram")[0] == 0
        for args in (("demo", "--device", "cuda"), ("bench",)):
            rc, out, err = run(*args)
            assert rc == 1, (args, rc, out, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and "pip install '.[cuda]'" in lines[0], (args, err)
            assert "torpor bench: torpor bench" not in lines[0], lines[0]  # the command is named once
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "cuda"))
        assert not loaded, loaded
        print("ok")
        """,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("ok")


def test_gpu_allocator_without_the_extra_names_it(tmp_path: Path) -> None:
    """TaggedAllocator on CUDA and CudaDriver without torch or cuda-bindings raise MissingExtra naming the cuda extra."""
    done = _without_torch(
        tmp_path,
        """
        from torpor.allocator import CudaDriver, SimDriver, TaggedAllocator
        from torpor.errors import MissingExtra

        # No CUDA driver here to build a GPU allocator on (that fails first, saying libcuda is missing):
        # a simulated one that takes the GPU path into torch's memory pools.
        TaggedAllocator.on_cuda = property(lambda self: True)
        alloc = TaggedAllocator(SimDriver(capacity=64 << 20))
        try:
            with alloc.use_memory_pool("weights"):
                pass
        except MissingExtra as exc:
            print("pools:", exc)
        try:
            CudaDriver().ensure_context(0)
        except MissingExtra as exc:
            print("driver:", exc)
        """,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("pools: TaggedAllocator's CUDA memory pools (use_memory_pool, capture) needs torch"), (
        lines
    )
    assert lines[1].startswith("driver: the CUDA driver (CudaDriver, TaggedAllocator on a GPU) needs cuda-bindings"), (
        lines
    )
    assert all("pip install '.[cuda]' from a torpor checkout" in line for line in lines)
