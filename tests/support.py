"""Helpers shared by several test modules: Prometheus exposition samples, a tiny model config and a model-less Worker for vLLM, a free port, a held call, a real Prometheus, the two-GPU tests' worker processes."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parent.parent
# NVLink multicast stays off in multi-GPU workers (see the device notes on the two-GPU machines).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# A Llama config small enough for vLLM's ModelConfig on a CPU machine (no weights, no download).
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def samples(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry's text exposition keyed by (name, labels)."""
    from prometheus_client import generate_latest  # imported here: the GPU tests' workers import this module too
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(got: Samples, name: str, **labels: str) -> float:
    """One sample's value (KeyError when absent)."""
    return got[(name, frozenset(labels.items()))]


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for a server or a process group to bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hold_call(obj: Any, name: str, wait: float) -> tuple[threading.Event, threading.Event]:
    """Make ``obj.name`` wait mid-command: returns ``(inside, go_on)``.

    A call sets ``inside`` on entering, then waits for ``go_on`` (at most ``wait`` seconds) before
    running the real method, so a test can act while a command is in flight.
    """
    inside, go_on = threading.Event(), threading.Event()
    real = getattr(obj, name)

    def held(*args: Any, **kwargs: Any) -> Any:
        inside.set()
        go_on.wait(wait)
        return real(*args, **kwargs)

    setattr(obj, name, held)
    return inside, go_on


@contextmanager
def real_prometheus(tmp: Path, target_port: int) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real Prometheus (on PATH) on a free loopback port, scraping ``127.0.0.1:target_port`` every second.

    Yields its URL and process, and terminates it on leaving. Its configuration, data and log
    (``prometheus.log``, warnings and worse) are in ``tmp``. It may not be ready yet: callers wait
    for what they need (readiness, a first scrape) themselves.
    """
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: torpor\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n"
    )
    port = free_port()
    with (tmp / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield f"http://127.0.0.1:{port}", proc
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def model_less_worker(model_config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's GPU Worker with its sleep path intact and no model (needs vllm and torch)."""
    import torch
    from vllm.v1.worker import gpu_worker

    worker: Any = gpu_worker.Worker.__new__(gpu_worker.Worker)
    worker.vllm_config = SimpleNamespace(model_config=model_config)
    worker.model_config = model_config
    worker.model_runner = SimpleNamespace(model=torch.nn.Linear(2, 2), get_draft_model=lambda: None)
    worker._sleep_mode_backend = None
    worker._sleep_saved_buffers, worker._sleep_saved_parameters, worker._sleep_saved_draft_buffers = {}, {}, {}
    monkeypatch.setattr(worker, "synchronize_device", lambda: None)
    return worker


def rank_worker_main(
    description: str | None,
    timeout: float,
    work: Callable[[argparse.Namespace, dict[str, Any]], None],
    modes: Sequence[str] = (),
) -> int:
    """A multi-GPU test's worker process (the test file run as a script by :func:`spawn_ranks`).

    Parses ``--rank --port --logdir --out`` (and ``--mode``, one of ``modes``, the first by
    default), runs ``work(args, result)`` and writes ``result`` to ``--out`` as JSON even when it
    fails, with the error under ``"error"``, so a failure shows how far it got. A hung worker prints
    every thread's Python stack and exits 30 s before the parent's kill at ``timeout``.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--logdir", required=True)
    if modes:
        parser.add_argument("--mode", choices=list(modes), default=modes[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    faulthandler.dump_traceback_later(timeout - 30, exit=True)
    try:
        work(args, result)
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        Path(args.out).write_text(json.dumps(result))
    return 0


def spawn_ranks(
    script: str,
    tmp_path: Path,
    *,
    world: int,
    timeout: float,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    evidence: str | None = None,
) -> tuple[list[dict[str, Any]], list[int], str]:
    """Run ``script`` once per rank (a :func:`rank_worker_main`) on one loopback port, NVLink multicast off.

    Each rank gets ``--rank --port --logdir tmp_path/logs --out tmp_path/rank<r>.json`` then ``args``;
    its output goes to ``tmp_path/rank<r>.log``. The environment is this one without
    NCCL_GRAPH_REGISTER, plus :data:`NO_MULTICAST` and ``env``. A rank still running at ``timeout``
    is killed with the others. Returns the ranks' results, exit codes and output tails; fails the
    test when a rank wrote no result or an error. ``evidence``: print each rank's log lines that
    contain it (for the record, not asserted).
    """
    environ = {k: v for k, v in os.environ.items() if k != "NCCL_GRAPH_REGISTER"}
    environ.update(NO_MULTICAST)
    environ.update(env or {})
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), environ.get("PYTHONPATH", "")) if p)
    environ["PYTHONUNBUFFERED"] = "1"
    port = free_port()
    procs = []
    for rank in range(world):
        cmd = [sys.executable, script, "--rank", str(rank), "--port", str(port), "--logdir", str(tmp_path / "logs")]
        cmd += ["--out", str(tmp_path / f"rank{rank}.json"), *args]
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115  (closed below)
        procs.append((subprocess.Popen(cmd, env=environ, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            codes.append(-9)
        finally:
            log.close()
    outputs = "\n".join(
        f"--- rank {r} (exit {c}):\n" + (tmp_path / f"rank{r}.log").read_text()[-8000:] for r, c in enumerate(codes)
    )
    missing = [r for r in range(world) if not (tmp_path / f"rank{r}.json").exists()]
    if missing:
        pytest.fail(f"workers {missing} wrote no result:\n{outputs}")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    print(json.dumps(results, indent=1))
    if evidence is not None:
        for r in range(world):
            said = [line for line in (tmp_path / f"rank{r}.log").read_text().splitlines() if evidence in line]
            print(f"rank {r}:", said or f"no line with {evidence}")
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        pytest.fail(f"workers failed ({'; '.join(errors)}); results so far: {json.dumps(results)}\n{outputs}")
    return results, codes, outputs
