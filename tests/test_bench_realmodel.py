"""torpor.bench.realmodel's torch_memory_saver rows off the GPU: each backend's saver calls, the row names and order.

The model, its graph and the device are replaced by stand-ins (the real run needs CUDA and
transformers, tests/test_models_gpu.py); the saver is a fake that records what it is asked.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from torpor.bench import realmodel as rm
from torpor.bench import tmsbackends as tb
from torpor.bench.result import Result
from torpor.errors import BadArgument
from torpor.units import GiB

torch = pytest.importorskip("torch", reason="run_tms_model imports torch (its CUDA calls are replaced here)")


class FakeSaver:
    """A torch_memory_saver that records its calls; a disk-backed pause writes a file in the disk folder."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.disk: Path | None = None
        self.disk_tags: set[str] = set()
        self._tag = ""

    @contextmanager
    def region(self, **kwargs: Any) -> Iterator[None]:
        self.calls.append(("region", kwargs))
        if kwargs.get("enable_disk_backup"):
            self.disk_tags.add(kwargs["tag"])
        yield

    def set_disk_backup_dir(self, path: str) -> None:
        self.calls.append(("set_disk_backup_dir", path))
        self.disk = Path(path)

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))
        if tag in self.disk_tags:
            assert self.disk is not None and self.disk.is_dir(), "the disk folder exists while the run pauses"
            (self.disk / f"{tag}.bin").write_bytes(b"w" * 4096)

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))
        if tag in self.disk_tags and self.disk is not None:
            (self.disk / f"{tag}.bin").unlink()


@pytest.fixture
def savers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, FakeSaver]:
    """One fake saver per system; the model, graph, device and RSS replaced; the mount table says ext4."""
    made: dict[str, FakeSaver] = {}

    def saver_of(system: str) -> FakeSaver:
        return made.setdefault(system, FakeSaver())

    model = types.SimpleNamespace(
        parameters=lambda: [types.SimpleNamespace(nbytes=3 * GiB)], buffers=lambda: [types.SimpleNamespace(nbytes=GiB)]
    )
    monkeypatch.setattr(rm, "torch_mode_saver", saver_of)
    monkeypatch.setattr(rm, "config", lambda: "cfg")
    monkeypatch.setattr(rm, "build", lambda cfg: model)
    monkeypatch.setattr(rm, "kv_block", lambda: "kv")
    monkeypatch.setattr(rm, "prompt", lambda cfg: "ids")
    monkeypatch.setattr(rm, "capture", lambda model, ids: ("graph", torch.zeros(2)))
    monkeypatch.setattr(rm, "replay_equal", lambda graph, out, ref: True)
    monkeypatch.setattr(rm, "free_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    rss = iter(range(0, 10**6 * GiB, GiB))  # each reading one GiB above the one before
    monkeypatch.setattr(tb, "rss_bytes", lambda: next(rss))
    table = tmp_path / "mounts"
    table.write_text("/dev/vda / ext4 rw 0 0\n")
    monkeypatch.setattr(tb, "MOUNTS", table)
    return made


def _regions(saver: FakeSaver) -> list[dict[str, Any]]:
    return [args for call, args in saver.calls if call == "region"]


@pytest.mark.parametrize(
    ("backend", "weights"),
    [
        ("pinned", {"tag": "weights", "enable_cpu_backup": True, "cpu_backup_backend": "pinned"}),
        ("mmap", {"tag": "weights-mmap", "enable_cpu_backup": True, "cpu_backup_backend": "mmap"}),
        ("disk", {"tag": "weights-disk", "enable_disk_backup": True}),
    ],
)
@pytest.mark.parametrize("system", ["torpor.tms", "torch_memory_saver"])
def test_each_backend_puts_the_weights_in_its_region_and_the_kv_block_in_one_without_backup(
    savers: dict[str, FakeSaver], system: str, backend: str, weights: dict[str, Any], tmp_path: Path
) -> None:
    """The weights' region has the backend's arguments and tag, the KV block's none; every cycle pauses and resumes both."""
    res = rm.run_tms_model(2, system, backend, tmp_path / "parent")
    saver = savers[system]
    assert _regions(saver) == [weights, {"tag": "kv_cache", "enable_cpu_backup": False}]
    tag = weights["tag"]
    cycle = [("pause", tag), ("pause", "kv_cache"), ("resume", tag), ("resume", "kv_cache")]
    assert [c for c in saver.calls if c[0] in ("pause", "resume")] == cycle * 2
    assert res.system == tb.row_name(system, backend) and res.exact
    assert res.nbytes == 4 * GiB and len(res.sleeps) == len(res.wakes) == 2
    assert res.host_held == GiB  # each RSS reading is one GiB above the last: measured, not assumed
    assert "+1.00 GiB paused, +2.00 GiB after resume" in res.note


def test_the_disk_backend_names_a_fresh_folder_under_the_parent_first_and_removes_it(
    savers: dict[str, FakeSaver], tmp_path: Path
) -> None:
    """disk: set_disk_backup_dir(a new folder under the parent) before any region; the folder is gone after the run."""
    parent = tmp_path / "parent"
    res = rm.run_tms_model(1, "torpor.tms", "disk", parent)
    saver = savers["torpor.tms"]
    assert saver.calls[0][0] == "set_disk_backup_dir"
    folder = Path(saver.calls[0][1])
    assert folder.parent == parent and not folder.exists() and list(parent.iterdir()) == []
    assert "in 1 file(s) while paused (ext4), 0 left after resume" in res.note


@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_cpu_backends_do_not_touch_the_disk_folder(savers: dict[str, FakeSaver], backend: str, tmp_path: Path) -> None:
    """pinned and mmap never call set_disk_backup_dir and make no folder."""
    rm.run_tms_model(1, "torch_memory_saver", backend, tmp_path / "parent")
    assert all(call != "set_disk_backup_dir" for call, _ in savers["torch_memory_saver"].calls)
    assert not (tmp_path / "parent").exists()


def test_a_saver_not_importable_is_a_row_named_for_its_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the package the row is reported (not exact, why in the note) under the backend's row name."""

    def missing(system: str) -> None:
        raise ModuleNotFoundError("No module named 'torch_memory_saver'")

    monkeypatch.setattr(rm, "torch_mode_saver", missing)
    res = rm.run_tms_model(2, "torch_memory_saver", "mmap")
    assert res.system == "torch_memory_saver mmap" and not res.exact and "not importable" in res.note


def _stub_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    ran: list[str] = []
    monkeypatch.setattr(rm, "run_torpor_model", lambda cycles: ran.append("torpor") or Result("torpor", "w", 0, 0))
    monkeypatch.setattr(
        rm, "run_baseline_model", lambda cycles: ran.append("vllm-style") or Result("vllm-style", "w", 0, 0)
    )
    return ran


def test_run_real_model_runs_torpor_tms_then_tms_for_each_backend(
    savers: dict[str, FakeSaver], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rows: torpor, the vLLM-style loop, then per backend in the order asked torpor.tms and torch_memory_saver."""
    _stub_runs(monkeypatch)
    rows = [r.system for r in rm.run_real_model(2, True, ("mmap", "pinned", "disk"), tmp_path)]
    assert rows == [
        "torpor",
        "vllm-style",
        "torpor.tms mmap",
        "torch_memory_saver mmap",
        "torpor.tms",
        "torch_memory_saver",
        "torpor.tms disk",
        "torch_memory_saver disk",
    ]
    assert rm.run_real_model.__defaults__ is not None and tb.TMS_BACKENDS in rm.run_real_model.__defaults__
    no_tms = [r.system for r in rm.run_real_model(2, False, ("disk",), tmp_path)]
    assert no_tms == ["torpor", "vllm-style", "torpor.tms disk"]


def test_run_real_model_refuses_an_unknown_backend_before_any_row_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown backend is refused naming the valid ones, and nothing has run."""
    ran = _stub_runs(monkeypatch)
    with pytest.raises(BadArgument, match="pinned, mmap, disk"):
        rm.run_real_model(2, True, ("pinned", "nvme"))
    with pytest.raises(BadArgument, match="nvme"):
        rm.run_tms_model(2, "torpor.tms", "nvme")
    assert ran == []


def test_run_real_model_refuses_a_disk_folder_on_tmpfs_before_any_row_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With disk asked, a folder on tmpfs is refused before the first row; without disk it is not looked at."""
    ran = _stub_runs(monkeypatch)
    table = tmp_path / "mounts"
    table.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path} tmpfs rw 0 0\n")
    monkeypatch.setattr(tb, "MOUNTS", table)
    monkeypatch.setattr(rm, "run_tms_model", lambda *args: Result(tb.row_name(args[1], args[2]), "w", 0, 0))
    with pytest.raises(BadArgument, match="tmpfs"):
        rm.run_real_model(2, True, ("pinned", "disk"), tmp_path / "disk")
    assert ran == []
    assert len(rm.run_real_model(2, True, ("pinned",), tmp_path / "disk")) == 4
