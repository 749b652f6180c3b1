"""The torpor sleep backend driven through vLLM's own interfaces on the simulated device (TaggedAllocator + SimDriver)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from support import TINY_LLAMA, model_less_worker  # noqa: E402

from torpor.allocator import SimDriver, TaggedAllocator  # noqa: E402
from torpor.errors import InvalidTransition  # noqa: E402
from torpor.hooks import fleet, reset_warnings  # noqa: E402
from torpor.hooks.vllm import activation, facade, pooldecision, process, settings  # noqa: E402
from torpor.statemachine import EventKind, read_events  # noqa: E402
from torpor.units import MiB  # noqa: E402

# vLLM's GPU worker module, imported before any test makes the platform answer as CUDA (its import runs CUDA ops then).
gpu_worker = pytest.importorskip("vllm.v1.worker.gpu_worker")


def import_cumem() -> Any:
    """vLLM's cumem module; without libcuda (this CPU machine) it is imported without its C extension."""
    try:
        return importlib.import_module("vllm.device_allocator.cumem")
    except ImportError:
        sys.modules["vllm.cumem_allocator"] = None  # type: ignore[assignment]
        return importlib.import_module("vllm.device_allocator.cumem")


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """torpor active in this process on a simulated device, with vLLM's platform answering as CUDA."""
    from vllm.config import VllmConfig
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.distributed.device_communicators import pynccl_allocator
    from vllm.platforms import current_platform

    cumem = import_cumem()
    saved = (
        VllmConfig.__dict__["__post_init__"],
        VllmConfig.__dict__["use_cumem_cudagraph_pool"],
        dict(SleepModeBackendFactory._registry),
        cumem.CuMemAllocator.instance,
        pynccl_allocator._graph_pool_id,
    )
    for name in (
        process.ENV_ACTIVE,
        "NCCL_GRAPH_REGISTER",
        "PROMETHEUS_MULTIPROC_DIR",
        "TORPOR_METRICS_DIR",
        settings.ENV_ENGINE,
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(current_platform, "device_type", "cpu")
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(current_platform, "is_rocm", lambda: False)
    monkeypatch.setattr(cumem, "cumem_available", True)  # the C extension is absent on this CPU machine
    pooldecision.forget_decisions()
    reset_warnings()
    driver = SimDriver(capacity=256 * MiB)
    allocator = facade.TorporMemAllocator(
        TaggedAllocator(driver), log_dir=tmp_path / "logs", engine="vllm", rank=0, fsync=False
    )
    previous = facade.configure(allocator)
    activation.register()
    activation.activate()
    try:
        yield SimpleNamespace(driver=driver, allocator=allocator, logs=tmp_path / "logs", tmp=tmp_path)
    finally:
        allocator.release_pools()
        activation.deactivate()
        activation.remove_probe()
        facade.configure(previous)
        VllmConfig.__post_init__ = saved[0]
        VllmConfig.use_cumem_cudagraph_pool = saved[1]
        SleepModeBackendFactory._registry.clear()
        SleepModeBackendFactory._registry.update(saved[2])
        cumem.CuMemAllocator.instance = saved[3]
        pynccl_allocator._graph_pool_id = saved[4]
        pooldecision.forget_decisions()


def torpor_model_config(tmp: Path) -> Any:
    """A real ModelConfig selecting the torpor backend with graph offload."""
    from vllm.config import ModelConfig

    path = tmp / "tiny"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    config = ModelConfig(
        model=str(path), skip_tokenizer_init=True, sleep_mode_backend="torpor", sleep_mode_offload_cudagraph=True
    )
    config.enable_sleep_mode = True
    return config


def write_pattern(memory: TaggedAllocator, address: int, size: int, seed: int) -> bytes:
    """Write a recognisable pattern; return it."""
    data = bytes((seed + i) % 251 for i in range(size))
    memory.write(address, data)
    return data


def test_full_lifecycle_through_vllm_interfaces(engine: Any) -> None:
    """Load, capture, level-1 sleep, RL wake (weights then kv_cache), level-2 sleep and wake, discard: bytes intact."""
    from vllm.compilation.cudagraph_pool import capture_pool
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.device_allocator import get_mem_allocator_instance
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeBackendFactory
    from vllm.distributed.device_communicators import pynccl_allocator

    vllm_allocator = get_mem_allocator_instance()  # what vLLM's worker gets
    assert vllm_allocator is engine.allocator
    memory = engine.allocator.memory
    assert vllm_allocator.get_current_usage() == 0  # gpu_worker asserts this before loading weights
    size = 4 * MiB
    content: dict[str, tuple[int, bytes]] = {}
    for seed, tag in enumerate(("weights", "kv_cache", "runtime")):
        with vllm_allocator.use_memory_pool(tag=tag):
            address = memory.allocate(size)
        content[tag] = (address, write_pattern(memory, address, size, seed))
    assert vllm_allocator.get_current_usage() == 3 * size

    model_config = torpor_model_config(engine.tmp)
    config_class = type("Config", (), {"use_cumem_cudagraph_pool": VllmConfig.__dict__["use_cumem_cudagraph_pool"]})
    vllm_config = config_class()  # VllmConfig's predicate as installed now, on a config with CUDA graphs on
    vllm_config.model_config = model_config
    vllm_config.compilation_config = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    with capture_pool(None, vllm_config) as pool:  # vLLM's capture routing, through the extended predicate
        assert pool is not None
        assert pynccl_allocator._graph_pool_id == pool
        graph_address = memory.allocate(2 * MiB)
    content["cudagraph"] = (graph_address, write_pattern(memory, graph_address, 2 * MiB, 7))

    backend = SleepModeBackendFactory.create_backend(model_config)
    assert isinstance(backend, SleepModeBackend)
    assert backend.state() == "RUNNING"

    backend.suspend(1)
    assert backend.state() == "SUSPENDED"
    assert engine.driver.used == 0  # every byte of device memory released
    backend.resume(["weights"])
    assert backend.state() == "RESUMING"  # partially awake: kv_cache still asleep
    for tag in ("weights", "runtime", "cudagraph"):
        address, data = content[tag]
        assert memory.read(address, len(data)) == data, tag
    backend.resume(["kv_cache"])
    assert backend.state() == "RUNNING"

    backend.suspend(2)
    backend.resume(None)
    assert backend.state() == "RUNNING"
    address, data = content["cudagraph"]
    assert memory.read(address, len(data)) == data  # graphs are offloaded at level 2 as well

    with pytest.raises(InvalidTransition, match="only kv_cache, weights can be discarded while resident"):
        backend.discard(("runtime",))
    backend.discard(("kv_cache",))  # release_kv_cache_memory(): kv_cache released while awake
    assert backend.state() == "RESUMING"
    backend.resume(["kv_cache"])
    assert backend.state() == "RUNNING"
    backend.suspend(1)
    backend.discard(("weights",))
    backend.resume(None)
    assert backend.state() == "RUNNING"

    kinds = [e.kind for e in read_events(engine.logs / "vllm.rank0.jsonl")]
    assert kinds.count(EventKind.SLEEP_COMPLETED) == 3
    assert EventKind.GRAPH_CAPTURED in kinds
    assert EventKind.TAG_DISCARDED in kinds
    assert EventKind.REFUSED in kinds
    view = fleet(engine.logs)
    assert view.state == "awake"
    assert [r.rank for r in view.engine("vllm").ranks] == [0]


def test_facade_meets_vllm_memallocator_protocol(engine: Any) -> None:
    """Every method of vLLM's MemAllocator protocol exists on the facade with the same parameter names."""
    import inspect

    from vllm.device_allocator import MemAllocator

    for name, member in vars(MemAllocator).items():
        if name.startswith("_") or not callable(member):
            continue
        ours = getattr(engine.allocator, name)
        theirs = list(inspect.signature(member).parameters)[1:]
        assert list(inspect.signature(ours).parameters) == theirs, name


def test_allocator_level_sleep_maps_offload_tags_to_levels(engine: Any) -> None:
    """vLLM's allocator-level sleep(offload_tags) runs as a controller sleep: level 1 with weights, else level 2."""
    vllm_allocator = engine.allocator
    with vllm_allocator.use_memory_pool(tag="weights"):
        vllm_allocator.memory.allocate(2 * MiB)
    vllm_allocator.sleep(offload_tags=("weights", "runtime", "cudagraph"))
    assert vllm_allocator.controller.state.value == "asleep_l1"
    vllm_allocator.wake_up(None)
    vllm_allocator.sleep(offload_tags=("runtime", "cudagraph"))
    assert vllm_allocator.controller.state.value == "asleep_l2"
    vllm_allocator.wake_up(["weights"])
    assert vllm_allocator.controller.state.value == "awake"


def test_capabilities_answer_for_torpor_mechanism(engine: Any) -> None:
    """Capability classmethods: in-process memory sleep keeps communicators, compiled code and graphs; nothing durable."""
    from torpor.hooks.vllm.backend import TorporSleepBackend

    assert TorporSleepBackend.is_supported() is True  # a simulated device is configured
    assert TorporSleepBackend.preserves_communicators() is True
    assert TorporSleepBackend.preserves_compiled_artifacts() is True
    assert TorporSleepBackend.preserves_graphs_with_communicators() is True
    assert TorporSleepBackend.supports_durable_storage() is False


def test_worker_records_hook_decisions_and_release_closes(engine: Any) -> None:
    """Decisions unknown at start are recorded at the first capture (graph pool, all-reduce, NCCL); release closes the log."""
    from vllm.config import CUDAGraphMode

    def kinds_and_hooks() -> list[str]:
        return [
            e.data["hook"] if e.kind is EventKind.HOOK_DECISION else e.kind.value
            for e in read_events(engine.logs / "vllm.rank0.jsonl")
        ]

    engine.allocator.controller  # noqa: B018 - first use starts the worker's controller
    assert "cudagraph_pool" not in kinds_and_hooks()  # no config visible: nothing guessed
    config = SimpleNamespace(
        model_config=torpor_model_config(engine.tmp),
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE),
    )
    state = process.current()
    assert state is not None
    state.decisions.append(pooldecision.decision_for(config))  # what the probe keeps when a config selects torpor
    with engine.allocator.cudagraph_pool():
        pass
    engine.allocator.release_pools()
    engine.allocator.release_pools()  # vLLM's shutdown and torpor's atexit may both call it
    seen = kinds_and_hooks()
    decisions = seen.index("cudagraph_pool")
    assert seen[decisions : decisions + 3] == ["cudagraph_pool", "custom_allreduce", "nccl_graph_register"]
    assert seen.index("graph_captured") > decisions
    assert seen[-1] == "closed"
    assert seen.count("closed") == 1


def test_restarted_worker_recovers_an_interrupted_log(engine: Any) -> None:
    """A log left mid-sleep by a dead process is recovered by the next worker on that rank, not refused forever."""
    from support import raw_event

    from torpor.statemachine.log.eventlog import EventLog

    path = engine.logs / "vllm.rank0.jsonl"
    engine.logs.mkdir(parents=True, exist_ok=True)
    log = EventLog(path, fsync=False)
    for seq, (kind, data) in enumerate(
        [(EventKind.OPENED, {"usage": {}}), (EventKind.SLEEP_REQUESTED, {"level": 1, "plan": {}, "usage": {}})], 1
    ):
        event = raw_event(kind, seq, "vllm", 0, data)
        object.__setattr__(event, "pid", 1)  # a process that is gone
        log.append(event)
    log.close()
    controller = engine.allocator.controller
    assert controller.state.value == "awake"
    assert EventKind.RECOVERED in [e.kind for e in read_events(path)]


def test_vllm_worker_sleep_wake_and_discard(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own Worker.sleep/wake_up/discard reach torpor's backend; vLLM's memory check sees the simulated device."""
    import torch

    capacity = engine.driver.capacity
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *args: (capacity - engine.driver.used, capacity))
    model_config = torpor_model_config(engine.tmp)
    model_config.enable_cumem_allocator = True  # what vLLM's ModelConfig sets for sleep mode
    worker = model_less_worker(model_config, monkeypatch)  # the worker's sleep path, without a model

    memory = engine.allocator.memory
    with worker._maybe_get_memory_pool_context(tag="weights"):
        weights = memory.allocate(8 * MiB)
    with worker._maybe_get_memory_pool_context(tag="kv_cache"):
        memory.allocate(16 * MiB)
    data = write_pattern(memory, weights, 8 * MiB, 3)
    from torpor.hooks.vllm.backend import TorporSleepBackend

    assert isinstance(worker.sleep_mode_backend, TorporSleepBackend)
    worker.sleep(1)  # vLLM asserts that free memory did not drop and logs what sleep freed
    assert engine.driver.used == 0
    worker.wake_up(["weights"])
    assert worker.sleep_mode_backend.state() == "RESUMING"
    assert memory.read(weights, len(data)) == data
    worker.wake_up(["kv_cache"])
    assert worker.sleep_mode_backend.state() == "RUNNING"
    worker.sleep(2)
    worker.discard(("kv_cache",))
    worker.wake_up(None)
    assert engine.allocator.controller.state.value == "awake"
    assert engine.driver.used == 24 * MiB


def test_default_log_path_is_per_user_and_per_engine(
    engine: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Defaults: a 0700 log directory per user, an engine name per activating process; a second writer is refused."""
    import os
    import stat
    import tempfile

    from torpor.errors import LogLocked
    from torpor.testing import FakeMemory

    assert os.environ[settings.ENV_ENGINE] == f"vllm-{os.getpid()}"  # set by activate(): ranks inherit it
    monkeypatch.delenv(settings.ENV_LOG_DIR, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    theirs = tmp_path / "torpor-65534"  # another user's engines, in the same temp directory
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    first = facade.TorporMemAllocator(FakeMemory({"weights": 8}), rank=0, fsync=False)
    path = first.controller.log.path  # type: ignore[union-attr]
    mine = tmp_path / f"torpor-{os.geteuid()}"
    assert path == mine / f"vllm-{os.getpid()}.rank0.jsonl"
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700
    other_engine = facade.TorporMemAllocator(FakeMemory({"weights": 8}), engine="vllm-1", rank=0, fsync=False)
    assert other_engine.controller.log.path.parent == mine  # type: ignore[union-attr]  # no collision
    same = facade.TorporMemAllocator(FakeMemory({"weights": 8}), rank=0, fsync=False)
    with pytest.raises(LogLocked, match=str(path)):
        same.controller  # noqa: B018 - a second writer of the same engine and rank
    first.release_pools()
    other_engine.release_pools()
    assert list(theirs.iterdir()) == []


def test_allocator_after_release_raises_controller_closed(engine: Any) -> None:
    """After release_pools() (vLLM's shutdown), sleep and wake through the allocator raise ControllerClosed, not a file error."""
    from torpor.errors import ControllerClosed

    engine.allocator.controller  # noqa: B018 - started
    engine.allocator.release_pools()
    with pytest.raises(ControllerClosed, match="release_pools"):
        engine.allocator.sleep()
    with pytest.raises(ControllerClosed):
        engine.allocator.wake_up(None)
