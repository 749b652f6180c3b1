"""Helpers shared by several test modules: Prometheus exposition samples and a tiny model config for vLLM."""

from __future__ import annotations

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
