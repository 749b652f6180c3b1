"""The vLLM plugin against the real vllm package on the CPU: discovery, backend factory, flags, predicate, probe."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from support import TINY_LLAMA as SHARED_TINY_LLAMA  # noqa: E402

from torpor.errors import ActivationError  # noqa: E402
from torpor.hooks import register_graph_buffers, reset_warnings  # noqa: E402
from torpor.hooks.vllm import activation, facade, pooldecision, process  # noqa: E402
from torpor.testing import FakeMemory  # noqa: E402

TINY_LLAMA = {**SHARED_TINY_LLAMA, "torch_dtype": "float32", "rms_norm_eps": 1e-5}


def import_cumem() -> Any:
    """vLLM's cumem module; without libcuda (this CPU machine) it is imported without its C extension."""
    try:
        return importlib.import_module("vllm.device_allocator.cumem")
    except ImportError:
        sys.modules["vllm.cumem_allocator"] = None  # type: ignore[assignment]
        return importlib.import_module("vllm.device_allocator.cumem")


@pytest.fixture
def sandbox(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """Everything the plugin may change in this process, put back afterwards; event logs go to the test's own dir."""
    from vllm import plugins
    from vllm.config import VllmConfig
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.platforms import current_platform

    cumem = import_cumem()
    saved = {
        "post_init": VllmConfig.__dict__["__post_init__"],
        "predicate": VllmConfig.__dict__["use_cumem_cudagraph_pool"],
        "registry": dict(SleepModeBackendFactory._registry),
        "slot": cumem.CuMemAllocator.instance,
        "loaded": plugins.plugins_loaded,
        "facade": facade.configure(None),
    }
    for name in (
        process.ENV_ACTIVE,
        activation.ENV_PROBE,
        "NCCL_GRAPH_REGISTER",
        "VLLM_PLUGINS",
        "PROMETHEUS_MULTIPROC_DIR",
        "TORPOR_METRICS_DIR",
    ):
        monkeypatch.delenv(name, raising=False)
    # Not the default <tempdir>/torpor: another user's (or another run's) logs there are not ours to write.
    monkeypatch.setenv("TORPOR_LOG_DIR", str(tmp_path / "torpor-logs"))
    monkeypatch.setattr(current_platform, "device_type", "cpu")  # vLLM's DeviceConfig needs one here
    pooldecision.forget_decisions()
    reset_warnings()
    try:
        yield SimpleNamespace(cumem=cumem, platform=current_platform)
    finally:
        activation.deactivate()
        activation.remove_probe()
        VllmConfig.__post_init__ = saved["post_init"]
        VllmConfig.use_cumem_cudagraph_pool = saved["predicate"]
        SleepModeBackendFactory._registry.clear()
        SleepModeBackendFactory._registry.update(saved["registry"])
        cumem.CuMemAllocator.instance = saved["slot"]
        plugins.plugins_loaded = saved["loaded"]
        current = facade.configure(saved["facade"])
        if current is not None:
            current.release_pools()
        pooldecision.forget_decisions()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Llama config directory, so vLLM's ModelConfig needs no download."""
    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return path


def model_config(path: Path, backend: str, *, sleep: bool = True, offload: bool = True) -> Any:
    """A real vLLM ModelConfig; sleep mode is set after construction (vLLM refuses it on a CPU platform)."""
    from vllm.config import ModelConfig

    config = ModelConfig(
        model=str(path), skip_tokenizer_init=True, sleep_mode_backend=backend, sleep_mode_offload_cudagraph=offload
    )
    config.enable_sleep_mode = sleep
    return config


def vllm_config(path: Path, backend: str, **kwargs: bool) -> Any:
    """A real VllmConfig (its __post_init__ runs, through the probe when installed)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(model_config=model_config(path, backend, **kwargs), device_config=DeviceConfig(device="cpu"))


def test_load_general_plugins_discovers_the_entry_point(sandbox: Any) -> None:
    """vLLM's own load_general_plugins() finds torpor's entry point, which registers backend 'torpor' and the probe."""
    from vllm import plugins
    from vllm.config import VllmConfig
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.plugins import load_general_plugins

    SleepModeBackendFactory._registry.pop("torpor", None)
    activation.remove_probe()
    plugins.plugins_loaded = False
    load_general_plugins()
    from torpor.hooks.vllm.backend import TorporSleepBackend

    assert SleepModeBackendFactory.get_backend_class("torpor") is TorporSleepBackend
    assert getattr(VllmConfig.__dict__["__post_init__"], "__torpor_probe__", False)
    assert not process.is_active()


def test_vllm_plugins_allowlist_without_torpor_skips_it(sandbox: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With VLLM_PLUGINS naming another plugin, vLLM does not load torpor: no backend, no probe."""
    from vllm import plugins
    from vllm.config import VllmConfig
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.plugins import load_general_plugins

    SleepModeBackendFactory._registry.pop("torpor", None)
    activation.remove_probe()
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    plugins.plugins_loaded = False
    load_general_plugins()
    assert "torpor" not in SleepModeBackendFactory._registry
    assert not getattr(VllmConfig.__dict__["__post_init__"], "__torpor_probe__", False)


def test_register_twice_is_harmless(sandbox: Any) -> None:
    """Loading the plugin again (vLLM may, per process) registers nothing twice and wraps nothing twice."""
    from vllm.config import VllmConfig

    activation.register()
    probe = VllmConfig.__dict__["__post_init__"]
    activation.register()
    assert VllmConfig.__dict__["__post_init__"] is probe
    assert probe.__wrapped__ is not probe


def test_engine_args_accept_the_flags(sandbox: Any, tiny_model: Path) -> None:
    """vLLM's CLI parser and EngineArgs take --enable-sleep-mode --sleep-mode-backend torpor --sleep-mode-offload-cudagraph."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    argv = ["--model", str(tiny_model), "--enable-sleep-mode", "--sleep-mode-backend", "torpor"]
    args = parser.parse_args([*argv, "--sleep-mode-offload-cudagraph"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.enable_sleep_mode, engine_args.sleep_mode_backend) == (True, "torpor")
    assert engine_args.sleep_mode_offload_cudagraph is True
    assert EngineArgs.from_cli_args(parser.parse_args(argv)).sleep_mode_offload_cudagraph is False


def test_create_backend_returns_torpor_backend(sandbox: Any, tiny_model: Path) -> None:
    """SleepModeBackendFactory.create_backend gives torpor's SleepModeBackend for a config selecting it, CuMem's otherwise."""
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend, SleepModeBackend, SleepModeBackendFactory

    from torpor.hooks.vllm.backend import TorporSleepBackend

    activation.register()
    facade.configure(facade.TorporMemAllocator(FakeMemory({"weights": 8}), engine="t", rank=0))
    activation.activate()
    backend = SleepModeBackendFactory.create_backend(model_config(tiny_model, "torpor"))
    assert isinstance(backend, TorporSleepBackend)
    assert isinstance(backend, SleepModeBackend)
    assert backend.state() == "RUNNING"
    assert isinstance(SleepModeBackendFactory.create_backend(model_config(tiny_model, "cumem")), CuMemBackend)


def test_backend_refuses_without_cuda_or_activation(sandbox: Any, tiny_model: Path) -> None:
    """No CUDA and no configured memory: unsupported; configured but not active here: refused, saying why."""
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    activation.register_backend()
    with pytest.raises(ValueError, match="not supported"):
        SleepModeBackendFactory.create_backend(model_config(tiny_model, "torpor"))
    facade.configure(facade.TorporMemAllocator(FakeMemory({"weights": 8}), engine="t", rank=0))
    with pytest.raises(facade.NotWired, match="not active in process"):
        SleepModeBackendFactory.create_backend(model_config(tiny_model, "torpor"))


def fake_config(backend: str, *, sleep: bool = True, offload: bool = True, graphs: bool = True) -> Any:
    """An object with the fields vLLM's predicate reads."""
    from vllm.config import CUDAGraphMode

    mode = CUDAGraphMode.FULL_AND_PIECEWISE if graphs else CUDAGraphMode.NONE
    model = SimpleNamespace(enable_sleep_mode=sleep, sleep_mode_backend=backend, sleep_mode_offload_cudagraph=offload)
    return SimpleNamespace(model_config=model, compilation_config=SimpleNamespace(cudagraph_mode=mode))


def set_platform(platform: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make vLLM's current platform answer as CUDA or as a CPU."""
    cuda = name == "cuda"
    monkeypatch.setattr(platform, "is_cuda", lambda: cuda)
    monkeypatch.setattr(platform, "is_cuda_alike", lambda: cuda)
    monkeypatch.setattr(platform, "is_rocm", lambda: False)
    pooldecision.forget_decisions()


PREDICATE_CASES = [
    # backend, sleep, offload, graphs, platform, expected
    ("torpor", True, True, True, "cuda", True),
    ("cumem", True, True, True, "cuda", True),
    ("torpor", True, False, True, "cuda", False),  # option off
    ("cumem", True, False, True, "cuda", False),
    ("torpor", False, True, True, "cuda", False),  # sleep mode off
    ("torpor", True, True, False, "cuda", False),  # graphs off
    ("cumem", True, True, False, "cuda", False),
    ("torpor", True, True, True, "cpu", False),  # not CUDA
    ("cumem", True, True, True, "cpu", False),
    ("checkpoint", True, True, True, "cuda", False),  # another backend
]


@pytest.mark.parametrize(("backend", "sleep", "offload", "graphs", "platform", "expected"), PREDICATE_CASES)
def test_extended_predicate_answers_each_flag_combination(
    sandbox: Any,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    sleep: bool,
    offload: bool,
    graphs: bool,
    platform: str,
    expected: bool,
) -> None:
    """VllmConfig.use_cumem_cudagraph_pool under torpor: torpor's predicate for torpor, vLLM's own answer for the rest."""
    from vllm.config import VllmConfig

    original = VllmConfig.__dict__["use_cumem_cudagraph_pool"].fget
    set_platform(sandbox.platform, monkeypatch, platform)
    config = fake_config(backend, sleep=sleep, offload=offload, graphs=graphs)
    vllm_answer = original(config)
    activation.activate()
    answer = VllmConfig.__dict__["use_cumem_cudagraph_pool"].fget(config)
    assert answer is expected
    if backend != "torpor":
        assert answer == vllm_answer
    else:
        assert vllm_answer is False  # vLLM alone never routes a non-cumem backend
        decision = pooldecision.decision_for(config)
        assert decision.active is expected
        assert register_graph_buffers(decision) is (not answer)


def test_vllm_consumers_read_the_predicate() -> None:
    """Capture routing, CudaCommunicator and the NCCL default in vLLM read use_cumem_cudagraph_pool (what torpor extends)."""
    from vllm.compilation import cudagraph_pool
    from vllm.config import VllmConfig
    from vllm.distributed.device_communicators import cuda_communicator

    assert "vllm_config.use_cumem_cudagraph_pool" in inspect.getsource(cudagraph_pool.capture_pool)
    assert "not config.use_cumem_cudagraph_pool" in inspect.getsource(cuda_communicator)
    config_source = inspect.getsource(importlib.import_module("vllm.config.vllm"))
    assert "if self.use_cumem_cudagraph_pool:" in config_source
    assert 'os.environ.setdefault("NCCL_GRAPH_REGISTER", "0")' in config_source
    assert "use_cumem_cudagraph_pool" in VllmConfig.__dict__


def test_probe_leaves_other_backends_alone(sandbox: Any, tiny_model: Path) -> None:
    """A config selecting cumem (or sleep mode off) changes nothing: predicate, allocator slot and environment as before."""
    from vllm.config import VllmConfig

    activation.register()
    before = (VllmConfig.__dict__["use_cumem_cudagraph_pool"], sandbox.cumem.CuMemAllocator.instance)
    cumem_config = vllm_config(tiny_model, "cumem")
    vllm_config(tiny_model, "torpor", sleep=False)
    assert not process.is_active()
    assert (VllmConfig.__dict__["use_cumem_cudagraph_pool"], sandbox.cumem.CuMemAllocator.instance) == before
    assert process.ENV_ACTIVE not in os.environ
    assert "NCCL_GRAPH_REGISTER" not in os.environ
    assert cumem_config.use_cumem_cudagraph_pool is False


def test_config_selecting_torpor_activates_and_deactivate_restores(sandbox: Any, tiny_model: Path) -> None:
    """Building a VllmConfig that selects torpor installs the predicate and the allocator slot; deactivate() undoes both."""
    from vllm.config import VllmConfig

    activation.register()
    original = VllmConfig.__dict__["use_cumem_cudagraph_pool"]
    config = vllm_config(tiny_model, "torpor")
    assert process.is_active()
    assert sandbox.cumem.CuMemAllocator.instance is facade.get_instance()
    assert VllmConfig.__dict__["use_cumem_cudagraph_pool"] is not original
    assert os.environ[process.ENV_ACTIVE] == "1"
    state = process.current()
    assert state is not None
    assert state.decisions[-1].missing == ("cudagraphs", "cuda_platform")  # eager, CPU: inactive, and it says why
    assert "NCCL_GRAPH_REGISTER" not in os.environ  # inactive: environment untouched
    assert config.use_cumem_cudagraph_pool is False
    activation.deactivate()
    assert VllmConfig.__dict__["use_cumem_cudagraph_pool"] is original
    assert sandbox.cumem.CuMemAllocator.instance is None
    assert process.ENV_ACTIVE not in os.environ


def test_get_mem_allocator_instance_hands_out_torpor_facade(sandbox: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, vLLM's get_mem_allocator_instance() returns torpor's facade while active, CuMemAllocator's slot otherwise."""
    from vllm.device_allocator import get_mem_allocator_instance

    monkeypatch.setattr(sandbox.platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(sandbox.cumem, "cumem_available", True)  # the C extension is absent on this CPU machine
    activation.activate()
    assert get_mem_allocator_instance() is facade.get_instance()
    activation.deactivate()
    assert sandbox.cumem.CuMemAllocator.instance is None


def test_activation_refuses_when_cumem_already_holds_memory(sandbox: Any) -> None:
    """If vLLM's own allocator already holds bytes in this process, activation refuses and names them."""
    busy = SimpleNamespace(get_current_usage=lambda: 4096)
    sandbox.cumem.CuMemAllocator.instance = busy
    with pytest.raises(ActivationError, match="already holds 4096 bytes"):
        activation.activate()
    assert sandbox.cumem.CuMemAllocator.instance is busy
    assert not process.is_active()


def test_nccl_default_follows_torpor_predicate(sandbox: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the pool active, NCCL_GRAPH_REGISTER becomes 0 when unset; an explicit value is kept; inactive: untouched."""
    set_platform(sandbox.platform, monkeypatch, "cuda")
    seen: list[bool] = []

    def vllm_post_init(config: Any) -> None:  # what vLLM's __post_init__ does with the predicate
        from vllm.config import VllmConfig

        seen.append(VllmConfig.__dict__["use_cumem_cudagraph_pool"].fget(config))

    activation._post_init_selected(fake_config("torpor"), vllm_post_init, (), {})
    assert seen == [True]
    assert os.environ["NCCL_GRAPH_REGISTER"] == "0"
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    activation._post_init_selected(fake_config("torpor"), vllm_post_init, (), {})
    assert os.environ["NCCL_GRAPH_REGISTER"] == "1"
    monkeypatch.delenv("NCCL_GRAPH_REGISTER")
    activation._post_init_selected(fake_config("torpor", graphs=False), vllm_post_init, (), {})
    assert "NCCL_GRAPH_REGISTER" not in os.environ
    assert seen == [True, True, False]


def test_env_var_activates_a_spawned_process(sandbox: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that loads the plugin with TORPOR_VLLM_ACTIVE=1 (a spawned worker) activates at load."""
    monkeypatch.setenv(process.ENV_ACTIVE, "1")
    activation.register()
    assert process.is_active()


def test_import_torpor_does_not_import_vllm() -> None:
    """import torpor (and torpor.hooks.vllm) in a fresh interpreter leaves vllm unimported."""
    import subprocess

    code = "import sys, torpor, torpor.hooks, torpor.hooks.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


SPAWNED = """
import os, sys
from vllm.plugins import load_general_plugins
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
from vllm.config import VllmConfig
from torpor.hooks.vllm import process
load_general_plugins()
print("registered", "torpor" in SleepModeBackendFactory._registry)
print("active", process.is_active())
print("extended", hasattr(VllmConfig.__dict__["use_cumem_cudagraph_pool"].fget, "__torpor_original__"))
"""


def test_spawned_worker_activates_through_vllms_loader(tmp_path: Path) -> None:
    """A fresh process (a spawned worker) with TORPOR_VLLM_ACTIVE=1: vLLM's loader registers and activates torpor."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env[process.ENV_ACTIVE] = "1"
    done = subprocess.run(
        [sys.executable, "-c", SPAWNED], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["registered", "True", "active", "True", "extended", "True"]


def test_probe_can_be_turned_off(sandbox: Any, monkeypatch: pytest.MonkeyPatch, tiny_model: Path) -> None:
    """TORPOR_VLLM_PROBE=0: loading the plugin registers the backend and changes nothing in VllmConfig."""
    from vllm.config import VllmConfig

    monkeypatch.setenv(activation.ENV_PROBE, "0")
    activation.remove_probe()
    before = VllmConfig.__dict__["__post_init__"]
    activation.register()
    assert VllmConfig.__dict__["__post_init__"] is before
    vllm_config(tiny_model, "torpor")
    assert not process.is_active()


def test_activation_names_a_metrics_directory_for_the_workers_and_deactivation_withdraws_it(sandbox: Any) -> None:
    """The first process to activate with no metrics directory set names torpor's own in TORPOR_METRICS_DIR (not PROMETHEUS_MULTIPROC_DIR); deactivate() removes it."""
    activation.activate()
    path = os.environ.get("TORPOR_METRICS_DIR")
    assert path and os.path.isdir(path) and "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    activation.deactivate()
    assert "TORPOR_METRICS_DIR" not in os.environ and not os.path.exists(path)
