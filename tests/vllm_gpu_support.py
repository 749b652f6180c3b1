"""Shared by the vLLM GPU tests: the skip rules, the engine settings, the state as torpor's logs and /metrics say it.

The tests run vLLM 0.33 on the GPU machine through the kit in
``shared/vllm-gpu`` (``scripts/gpu-vllm`` sets it up and points
``TORPOR_VLLM_MODEL`` at the tiny Qwen3 that the kit's ``make_tiny_model.py``
builds offline). Without vLLM, a CUDA GPU or that model, they skip and say why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: The model directory (a config.json and weights): built by scripts/gpu-vllm.
ENV_MODEL = "TORPOR_VLLM_MODEL"
#: ``compile`` (default: torch.compile + FULL_AND_PIECEWISE CUDA graphs, vLLM's default) or ``graphs``
#: (full CUDA graphs of decode without torch.compile, which took 21-24 s of a start; graphs still offloaded).
ENV_MODE = "TORPOR_VLLM_MODE"
#: The ``graphs`` mode, as the kit's llm_smoke.py runs it (native custom ops, Triton attention).
GRAPHS_MODE: dict[str, Any] = {
    "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["none"]},
    "kernel_config": {"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}},
    "attention_config": {"backend": "TRITON_ATTN"},
}
#: The settings every engine of these tests shares, so a warm torch.compile cache serves them all.
MAX_MODEL_LEN = 1024
GPU_MEMORY_UTILIZATION = 0.3
MAX_NUM_SEQS = 16
MAX_NUM_BATCHED_TOKENS = 2048
PROMPTS = ["Hello, how are you today?", "The capital of France is", "def add(a, b):", "Once upon a time"]


def require_vllm_gpu() -> Path:
    """The model directory; skips the test when vLLM, a CUDA GPU or the model is missing."""
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (vLLM runs there through scripts/gpu-vllm)")
    model = os.environ.get(ENV_MODEL)
    if not model or not (Path(model) / "config.json").is_file():
        pytest.skip(f"{ENV_MODEL} names no model directory (scripts/gpu-vllm builds the tiny Qwen3 and sets it)")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the kit
    # torch.cuda.is_available() above (and the suite's device count) leaves this process unable to fork a CUDA
    # child while torch.cuda.is_initialized() stays False, which is all vLLM checks (vllm#32611): a forked engine
    # core then fails with "Cannot re-initialize CUDA in forked subprocess" (seen on the H200). Spawn it instead.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return Path(model)


def llm_kwargs(model: Path, backend: str = "torpor", **extra: Any) -> dict[str, Any]:
    """vllm.LLM's arguments: sleep mode with ``backend``, graphs offloaded, torch.compile + CUDA graphs."""
    kwargs: dict[str, Any] = {
        "model": str(model),
        "max_model_len": MAX_MODEL_LEN,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "enable_prefix_caching": False,
        "seed": 0,
        "enable_sleep_mode": True,
        "sleep_mode_backend": backend,
        "sleep_mode_offload_cudagraph": True,
    }
    if mode() == "graphs":
        kwargs.update(GRAPHS_MODE)
    kwargs.update(extra)
    return kwargs


def mode() -> str:
    """The engine mode of these tests (``TORPOR_VLLM_MODE``): ``compile`` or ``graphs``."""
    value = os.environ.get(ENV_MODE, "compile")
    if value not in ("compile", "graphs"):
        msg = f"{ENV_MODE}={value!r}: use compile or graphs"
        raise ValueError(msg)
    return value


def mode_args() -> list[str]:
    """The ``vllm serve`` flags of :func:`mode` (none for ``compile``)."""
    if mode() == "compile":
        return []
    return [
        "--compilation-config",
        json.dumps(GRAPHS_MODE["compilation_config"]),
        "--kernel-config",
        json.dumps(GRAPHS_MODE["kernel_config"]),
        "--attention-backend",
        GRAPHS_MODE["attention_config"]["backend"],
    ]


def serve_args(model: Path, port: int, *extra: str) -> list[str]:
    """The ``vllm serve`` command line (the same engine settings as :func:`llm_kwargs`)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--gpu-memory-utilization",
        str(GPU_MEMORY_UTILIZATION),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--max-num-batched-tokens",
        str(MAX_NUM_BATCHED_TOKENS),
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--enable-sleep-mode",
        "--sleep-mode-backend",
        "torpor",
        "--sleep-mode-offload-cudagraph",
        *mode_args(),
        *extra,
    ]


def torpor_status(log_dir: Path, engine: str) -> dict[str, Any]:
    """``torpor status DIR --engine ENGINE --json``, run as a user would (a separate process)."""
    done = subprocess.run(
        [sys.executable, "-m", "torpor", "status", str(log_dir), "--engine", engine, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        msg = f"torpor status exited {done.returncode}: {done.stderr.strip()}"
        raise AssertionError(msg)
    view: dict[str, Any] = json.loads(done.stdout)["engines"][0]
    return view


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text exposition as (name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def pick(rows: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> list[float]:
    """The values of ``name`` whose labels include ``labels``."""
    return [v for n, lab, v in rows if n == name and all(lab.get(k) == want for k, want in labels.items())]


def torpor_state_with_vllm_engine(rows: list[tuple[str, dict[str, str], float]]) -> dict[tuple[str, str], str]:
    """The recording rule ``torpor:state:vllm_engine`` in Python: (vLLM engine, rank) -> torpor's state.

    ``engine`` is the N of ``torpor_engine`` "NAME-dpN", else "0" (deploy/prometheus/torpor-rules.yml).
    """
    import re

    out: dict[tuple[str, str], str] = {}
    for name, lab, value in rows:
        if name == "torpor_state" and value == 1:
            m = re.fullmatch(r".+-dp([0-9]+)", lab.get("torpor_engine", ""))
            out[(m.group(1) if m else "0", lab.get("torpor_rank", ""))] = lab["state"]
    return out


def vllm_sleep_state(rows: list[tuple[str, dict[str, str], float]]) -> dict[str, str]:
    """vLLM engine index -> the ``sleep_state`` whose ``vllm:engine_sleep_state`` is 1."""
    return {
        lab.get("engine", ""): lab["sleep_state"] for n, lab, v in rows if n == "vllm:engine_sleep_state" and v == 1
    }


def tag_bytes(rows: list[tuple[str, dict[str, str], float]], tag: str, residency: str) -> float:
    """``torpor_tag_bytes`` of ``tag`` in ``residency`` summed over ranks (0 when absent)."""
    return sum(pick(rows, "torpor_tag_bytes", tag=tag, residency=residency))
