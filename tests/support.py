"""Helpers shared by several test modules: Prometheus exposition samples, a tiny model config and a model-less Worker for vLLM, a free port."""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

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


def model_less_worker(model_config: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's GPU Worker with its sleep path intact and no model (needs vllm and torch)."""
    import torch
    from vllm.v1.worker import gpu_worker

    worker = gpu_worker.Worker.__new__(gpu_worker.Worker)
    worker.vllm_config = SimpleNamespace(model_config=model_config)
    worker.model_config = model_config
    worker.model_runner = SimpleNamespace(model=torch.nn.Linear(2, 2), get_draft_model=lambda: None)
    worker._sleep_mode_backend = None
    worker._sleep_saved_buffers, worker._sleep_saved_parameters, worker._sleep_saved_draft_buffers = {}, {}, {}
    monkeypatch.setattr(worker, "synchronize_device", lambda: None)
    return worker
