"""Helpers shared by several test modules: the simulated-device rigs (presets, ``make_rig``), Prometheus exposition samples, a tiny model config and a model-less Worker for vLLM, a free port, a held call, a real Prometheus."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

from torpor.allocator import HostPolicy
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.core.policy import DEFAULT_POLICY
from torpor.statemachine.core.states import TRIGGER_EVENTS, destination
from torpor.statemachine.projection.view import Projection
from torpor.testrig import GRANULE as G  # the granularity of every rig preset but small_batches (64 KiB)
from torpor.testrig import SimRig, sim_rig
from torpor.units import GiB, KiB, MiB

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


#: The simulated devices tests build, by name: ``torpor.testrig.sim_rig``'s keywords (what is not named is its default).
RIG_PRESETS: dict[str, Mapping[str, Any]] = {
    # sim_rig() as it comes: 64 MiB of 64 KiB granules, the allocator's own defaults
    "default": {},
    # 64 MiB; copy batches of 4 granules, pieces of 2, slabs of 8; pinned ahead in 1 MiB chunks by 2 threads,
    # except the tags the default policy never backs up (as the controller passes them)
    "batched": {
        "capacity": 64 * MiB,
        "granularity": G,
        "host": HostPolicy(prepin=True, chunk_bytes=MiB, threads=2, prepin_exclude=DEFAULT_POLICY.never_backed_up()),
        "group_bytes": 4 * G,
        "piece_bytes": 2 * G,
        "slab_bytes": 8 * G,
    },
    # 256 MiB, batched as "batched", the allocator's own host policy (room for threads allocating at once)
    "batched_large": {
        "capacity": 256 * MiB,
        "granularity": G,
        "group_bytes": 4 * G,
        "piece_bytes": 2 * G,
        "slab_bytes": 8 * G,
    },
    # 64 MiB, no slabs (each allocation its own mapping); pinned at the first sleep in 1 MiB chunks by 2 threads
    "unslabbed": {
        "capacity": 64 * MiB,
        "granularity": G,
        "host": HostPolicy(prepin=False, chunk_bytes=MiB, threads=2),
        "slab_bytes": 0,
    },
    # 64 MiB, no slabs; a sleep copies through a ring of 4 one-granule slots (3 threads) into chunks of 8 granules
    "staged": {
        "capacity": 64 * MiB,
        "granularity": G,
        "host": HostPolicy(chunk_bytes=8 * G, threads=2, stage_slot_bytes=G, stage_ring_bytes=4 * G, stage_threads=3),
        "slab_bytes": 0,
    },
    # 64 MiB with 3 MiB taken before any allocation (a CUDA context), no slabs; chunks of 4 granules, 2 threads
    "with_context": {
        "capacity": 64 * MiB,
        "granularity": G,
        "overhead": 3 * MiB,
        "host": HostPolicy(chunk_bytes=4 * G, threads=2),
        "slab_bytes": 0,
    },
    # 8 MiB of 16 KiB granules, one copy batch per granule; pinned ahead in 128 KiB chunks by one thread;
    # host ranges given back are handed out again (as mmap after munmap may)
    "small_batches": {
        "capacity": 8 * MiB,
        "granularity": 16 * KiB,
        "reuse_host": True,
        "host": HostPolicy(prepin=True, chunk_bytes=128 * KiB, threads=1),
        "group_bytes": 16 * KiB,
    },
    # SimDriver's own defaults: 1 GiB of 2 MiB granules (CUDA's granularity), the allocator's own defaults
    "cuda_like": {"capacity": GiB, "granularity": 2 * MiB},
}


class RigMaker:
    """Builds rigs from :data:`RIG_PRESETS` for one test and closes each at its end (the ``make_rig`` fixture)."""

    def __init__(self) -> None:
        self.made: list[SimRig] = []

    def __call__(
        self, preset: str = "default", *, host_options: Mapping[str, Any] | None = None, **changes: Any
    ) -> SimRig:
        """A rig of ``preset``; ``changes`` replace its ``sim_rig`` keywords, ``host_options`` fields of its ``HostPolicy``."""
        if preset not in RIG_PRESETS:
            msg = f"no rig preset {preset!r}; the presets are {', '.join(RIG_PRESETS)}"
            raise KeyError(msg)
        settings = {**RIG_PRESETS[preset], **changes}
        if host_options:
            settings["host"] = dataclasses.replace(settings.get("host") or HostPolicy(), **host_options)
        rig = sim_rig(**settings)
        self.made.append(rig)
        return rig

    def close(self) -> None:
        """Teardown, the last rig first: disarm the faults a test left armed, then close the rig (controller, allocator, handles)."""
        while self.made:
            rig = self.made.pop()
            rig.driver.clear_faults()
            rig.close()


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


#: The trigger each state-moving event kind takes (the inverse of states.TRIGGER_EVENTS).
TRIGGER_OF = {kind: trigger for trigger, kind in TRIGGER_EVENTS.items()}


def off_table_moves(events: list[Event]) -> list[str]:
    """Every state change in ``events`` that is not an edge of the transition table (empty when all are).

    Folds the events one by one; each change of state must come from an event kind
    that takes a trigger, and the table's row for that trigger from the old state,
    with its conditions evaluated on the projection after the event, must lead to the
    new state. ``opened`` (a new process: fresh memory, awake) and ``snapshot`` set the
    state outright and are not moves.
    """
    proj = Projection()
    wrong = []
    for event in events:
        before = proj.state
        proj.apply(event)
        if proj.state is before or event.kind.value in ("opened", "snapshot"):
            continue
        trigger = TRIGGER_OF.get(event.kind.value)
        dest = None if trigger is None else destination(before, trigger, proj)
        if dest is not proj.state:
            wrong.append(f"#{event.seq} {event.kind.value}: {before} -> {proj.state}, the table says {dest}")
    return wrong


def count_log_calls(
    name: str,
    counter: Any,
    cycle: Any,
    tags: dict[str, int],
    fsync: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> int:
    """How many ``os.<name>`` calls on the log's file one ``cycle(ctrl)`` makes (a dry run with ``counter`` patched in).

    ``counter`` wraps ``os.<name>``: it has ``fd`` (set here to the log's descriptor), ``real`` and ``calls``.
    """
    from torpor.statemachine import EventLog, SleepController
    from torpor.testing import FakeMemory

    monkeypatch.setattr(os, name, counter)
    ctrl = SleepController(FakeMemory(tags), EventLog(tmp_path / "dry.jsonl", fsync=fsync))
    if ctrl.log is None:
        msg = "the dry run's controller has no log"
        raise RuntimeError(msg)
    counter.fd = ctrl.log._fd
    cycle(ctrl)
    monkeypatch.setattr(os, name, counter.real)
    ctrl.close()
    return int(counter.calls)


def raw_event(kind: EventKind, seq: int, engine: str, rank: int, data: Mapping[str, Any]) -> Event:
    """An event of ``kind`` whose data is ``data`` as given, stamped now: for tests that feed readers, codecs and
    checks events as a log holds them (torpor itself builds events from typed payloads only, with ``stamp``)."""
    return Event(kind, seq, time.time(), time.monotonic(), os.getpid(), engine, rank, data)


#: pytest with torch unimportable (a finder that refuses it), as on a machine where torch is not installed.
WITHOUT_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoTorch())
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def cuda_with_triton() -> Any:
    """torch, on a machine with a CUDA GPU and triton (the GPU's checksum kernels); else the test is skipped."""
    torch = pytest.importorskip("torch", reason="needs torch and a CUDA GPU")
    pytest.importorskip("triton", reason="the GPU's checksum kernels need triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch
