"""Worker metrics reach vLLM's API-server /metrics through PROMETHEUS_MULTIPROC_DIR (prometheus-client multiprocess mode)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

WORKER = textwrap.dedent(
    """
    import sys
    from torpor.allocator import SimDriver, TaggedAllocator
    from torpor.hooks.vllm.facade import TorporMemAllocator

    rank = int(sys.argv[1])
    allocator = TorporMemAllocator(
        TaggedAllocator(SimDriver(capacity=64 << 20)), log_dir=sys.argv[2], engine="vllm", rank=rank, fsync=False
    )
    with allocator.use_memory_pool("weights"):
        allocator.memory.allocate((rank + 1) << 21)
    allocator.controller.sleep(1)
    assert allocator.telemetry is not None, "telemetry was not attached"
    """
)


def test_worker_metrics_reach_vllm_metrics_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two worker processes sleep; vLLM's /metrics (its multiprocess registry) shows each rank's state and bytes."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    for rank in (0, 1):
        done = subprocess.run(
            [sys.executable, "-c", WORKER, str(rank), str(tmp_path / "logs")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    from vllm.entrypoints.serve.instrumentator import metrics

    app = FastAPI()
    metrics.attach_router(app)  # vLLM's /metrics: a MultiProcessCollector when the variable is set
    text = TestClient(app).get("/metrics").text
    for rank in ("0", "1"):
        state = [
            line
            for line in text.splitlines()
            if line.startswith("torpor_state{") and f'torpor_rank="{rank}"' in line and 'state="asleep_l1"' in line
        ]
        assert state, f"no asleep_l1 series for rank {rank} in /metrics"
        assert state[0].endswith(" 1.0")
    weights = [
        line
        for line in text.splitlines()
        if line.startswith("torpor_tag_bytes{") and 'tag="weights"' in line and 'residency="host"' in line
    ]
    assert sorted(float(line.rsplit(" ", 1)[1]) for line in weights) == [2.0 * (1 << 20), 4.0 * (1 << 20)]


SERVER = textwrap.dedent(
    """
    import os, subprocess, sys
    from torpor.allocator import SimDriver, TaggedAllocator
    from torpor.hooks.vllm import activation, facade

    facade.configure(facade.TorporMemAllocator(TaggedAllocator(SimDriver(capacity=16 << 20)), log_dir=sys.argv[2]))
    activation.activate()  # what a config selecting torpor does in vLLM's API server, before it starts the engine
    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ, "vLLM's own registry must stay as vLLM chose it"
    for rank in (0, 1):
        done = subprocess.run([sys.executable, "-c", sys.argv[1], str(rank), sys.argv[2]], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator import metrics

    app = FastAPI()
    metrics.attach_router(app)
    print(TestClient(app).get("/metrics").text)
    """
)


def test_worker_metrics_reach_vllm_metrics_with_no_multiproc_dir_set(tmp_path: Path) -> None:
    """With no PROMETHEUS_MULTIPROC_DIR set, the API server's activation gives the workers a metrics directory and vLLM's /metrics shows each rank's torpor_state."""
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")}
    env.pop("TORPOR_METRICS_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", SERVER, WORKER, str(tmp_path / "logs")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in ("0", "1"):
        state = [
            line
            for line in done.stdout.splitlines()
            if line.startswith("torpor_state{") and f'torpor_rank="{rank}"' in line and 'state="asleep_l1"' in line
        ]
        assert state, f"no asleep_l1 series for rank {rank} in /metrics:\n{done.stdout[-2000:]}"
        assert state[0].endswith(" 1.0")
    assert "python_info{" in done.stdout  # vLLM's /metrics still serves the global registry it chose
