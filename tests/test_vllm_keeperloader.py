"""vLLM load format torpor-keeper: registered with vLLM's loader registry; adopts a dead engine's weights, else loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from keeper_engine import running_keeper, start_engine, tiny_model

from torpor.hooks.vllm import keeperloader

pytestmark = pytest.mark.vllm
model_loader = pytest.importorskip("vllm.model_executor.model_loader")


@pytest.fixture
def keeper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A keeper process; this process's keeper socket, engine and rank point at it."""
    sock = tmp_path / "k" / "keeper.sock"
    monkeypatch.setenv("TORPOR_KEEPER_SOCKET", str(sock))
    monkeypatch.setenv(keeperloader.ENV_ENGINE, "serve")
    monkeypatch.setenv("TORPOR_RANK", "0")
    with running_keeper(sock):
        yield sock


class _Disk:
    """vLLM's default loader, stubbed: records that the checkpoint was loaded."""

    def __init__(self) -> None:
        self.loaded = 0

    def load_weights(self, model: object, model_config: object) -> None:
        self.loaded += 1


def _loader() -> tuple[object, _Disk]:
    keeperloader.register()
    loader = model_loader.get_model_loader(model_loader.LoadConfig(load_format=keeperloader.LOAD_FORMAT))
    disk = _Disk()
    loader.disk = disk  # type: ignore[attr-defined]
    return loader, disk


def test_the_load_format_is_registered_with_vllm() -> None:
    """register() makes --load-format torpor-keeper pick the keeper's loader, with vLLM's default loader behind it."""
    assert keeperloader.register()
    loader = model_loader.get_model_loader(model_loader.LoadConfig(load_format="torpor-keeper"))
    assert type(loader).__name__ == "KeeperModelLoader"
    assert isinstance(loader.disk, model_loader.DefaultModelLoader)
    assert loader.disk.load_config.load_format == "auto"


def test_a_restarted_engine_takes_its_weights_from_the_keeper(keeper: Path) -> None:
    """load_weights adopts rank 0's backup of the killed engine (model@revision matches); the checkpoint is not read."""
    proc, _ = start_engine(keeper, "serve-rank0", 4, "--source", "org/tiny@r1")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    loader, disk = _loader()
    model = tiny_model(12)
    loader.load_weights(model, SimpleNamespace(model="org/tiny", revision="r1"))  # type: ignore[attr-defined]
    assert disk.loaded == 0
    for (name, got), (_, ref) in zip(model.state_dict().items(), tiny_model(4).state_dict().items(), strict=True):
        assert torch.equal(got, ref), name


def test_nothing_kept_loads_the_checkpoint(keeper: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With no backup of this engine (or one of another revision) the default loader reads the checkpoint."""
    proc, _ = start_engine(keeper, "serve-rank0", 4, "--source", "org/tiny@r1")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    loader, disk = _loader()
    loader.load_weights(tiny_model(12), SimpleNamespace(model="org/tiny", revision="r2"))  # type: ignore[attr-defined]
    assert disk.loaded == 1 and "the backup is of 'org/tiny@r1', this process built 'org/tiny@r2'" in caplog.text


def test_the_vllm_plugin_registers_the_load_format_when_told() -> None:
    """torpor's vLLM plugin entry point, with $TORPOR_KEEPER_ENGINE set, makes --load-format torpor-keeper known."""
    code = (
        "from torpor.hooks.vllm.activation import register\n"
        "from vllm.model_executor.model_loader import LoadConfig, get_model_loader\n"
        "register()\n"
        "print(type(get_model_loader(LoadConfig(load_format='torpor-keeper'))).__name__)\n"
    )
    env = {**os.environ, "TORPOR_KEEPER_ENGINE": "serve", "TORPOR_VLLM_PROBE": "0"}
    env.pop("TORPOR_VLLM_ACTIVE", None)
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1:] == ["KeeperModelLoader"], done.stdout
