"""torpor.tms's TorchMemorySaver: TMS 0.0.10's names, arguments and defaults, its write-only properties, its errors."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support import RigMaker

import torpor.tms
from torpor.allocator import TaggedAllocator
from torpor.testrig import SimRig
from torpor.tms import TmsUsageError, TorchMemorySaver, configure_subprocess, torch_memory_saver
from torpor.units import MiB

WHEEL = Path(__file__).resolve().parent.parent / ".whl" / "torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl"
METHODS = ("region", "cuda_graph", "disable", "pause", "resume", "get_cpu_backup", "set_disk_backup_dir")
PROPERTIES = ("enabled", "hook_mode", "memory_margin_bytes", "retain_cpu_backup")


def shape(fn: object) -> list[tuple[str, str, object]]:
    """A signature as (name, kind, default), annotations left out (TMS writes Optional[...], torpor X | None)."""
    sig = inspect.signature(inspect.unwrap(fn))  # type: ignore[arg-type]
    return [(p.name, p.kind.name, p.default) for p in sig.parameters.values()]


def saver(rig: SimRig) -> TorchMemorySaver:
    """A saver bound to the rig's allocator, telemetry off."""
    s = TorchMemorySaver()
    s.bind(rig.allocator, telemetry=False)
    return s


def test_the_module_exports_tms_names() -> None:
    """The names a TMS user imports are there: the singleton, the class, configure_subprocess."""
    assert isinstance(torch_memory_saver, TorchMemorySaver)
    assert callable(configure_subprocess)
    for name in ("torch_memory_saver", "TorchMemorySaver", "configure_subprocess"):
        assert name in torpor.tms.__all__


def test_signatures_and_defaults() -> None:
    """region, cuda_graph, pause and resume take TMS's arguments with TMS's defaults."""
    assert shape(TorchMemorySaver.region) == [
        ("self", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("tag", "POSITIONAL_OR_KEYWORD", "default"),
        ("enable_cpu_backup", "POSITIONAL_OR_KEYWORD", False),
        ("enable_disk_backup", "POSITIONAL_OR_KEYWORD", False),
        ("cpu_backup_backend", "POSITIONAL_OR_KEYWORD", None),
    ]
    names = [n for n, _, _ in shape(TorchMemorySaver.cuda_graph)]
    assert names == [
        "self",
        "cuda_graph",
        "pool",
        "stream",
        "capture_error_mode",
        "tag",
        "enable_cpu_backup",
        "cpu_backup_backend",
    ]
    assert dict((n, d) for n, _, d in shape(TorchMemorySaver.cuda_graph))["capture_error_mode"] == "global"
    assert shape(TorchMemorySaver.pause)[1] == ("tag", "POSITIONAL_OR_KEYWORD", None)
    assert shape(TorchMemorySaver.get_cpu_backup)[2] == ("zero_copy", "POSITIONAL_OR_KEYWORD", False)


@pytest.mark.skipif(not WHEEL.is_file(), reason="the real torch_memory_saver 0.0.10 wheel is not in .whl/")
def test_signatures_match_the_real_tms(tmp_path: Path) -> None:
    """Every public method and property of the real 0.0.10 has torpor's counterpart, with the same signature."""
    pytest.importorskip("torch")
    pytest.importorskip("numpy")
    with zipfile.ZipFile(WHEEL) as whl:
        whl.extractall(tmp_path)
    code = (
        "import inspect, json, torch_memory_saver as t\n"
        "c = t.TorchMemorySaver\n"
        "pub = sorted(n for n in vars(c) if not n.startswith('_'))\n"
        "sig = {n: [(p.name, p.kind.name, repr(p.default)) for p in inspect.signature(inspect.unwrap(getattr(c, n)))"
        ".parameters.values()] for n in pub if callable(getattr(c, n))}\n"
        "props = sorted(n for n in pub if isinstance(vars(c)[n], property))\n"
        "print(json.dumps({'public': pub, 'sig': sig, 'props': props, 'all': sorted(n for n in dir(t) if not n.startswith('_'))}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True, timeout=120
    )
    real = json.loads(out.stdout.strip().splitlines()[-1])
    ours = TorchMemorySaver
    assert sorted(n for n in vars(ours) if not n.startswith("_") and n != "bind") == real["public"]
    for name, params in real["sig"].items():
        mine = [
            (p.name, p.kind.name, repr(p.default))
            for p in inspect.signature(inspect.unwrap(getattr(ours, name))).parameters.values()
        ]
        assert mine == [tuple(p) for p in params], name
    assert sorted(n for n in vars(ours) if isinstance(vars(ours)[n], property)) == real["props"]
    for name in ("TorchMemorySaver", "configure_subprocess", "torch_memory_saver"):
        assert name in real["all"] and hasattr(torpor.tms, name)


def test_write_only_properties(make_rig: RigMaker) -> None:
    """hook_mode and memory_margin_bytes are write-only; enabled is True; retain_cpu_backup reads back."""
    rig = make_rig("cuda_like", capacity=64 * MiB)
    s = saver(rig)
    assert s.enabled is True
    with pytest.raises(AttributeError):
        _ = s.hook_mode
    with pytest.raises(NotImplementedError, match="Only setter is supported"):
        _ = s.memory_margin_bytes
    s.hook_mode = "torch"
    s.memory_margin_bytes = 1 << 20
    assert s.retain_cpu_backup is False
    s.retain_cpu_backup = True
    assert s.retain_cpu_backup is True


def test_hook_mode_after_initialization_is_refused(make_rig: RigMaker) -> None:
    """hook_mode (and bind) after the first call is refused, as TMS's assert does."""
    rig = make_rig("cuda_like", capacity=64 * MiB)
    s = saver(rig)
    s.pause("kv_cache")
    with pytest.raises(TmsUsageError, match="Cannot configure after initialization"):
        s.hook_mode = "torch"
    with pytest.raises(TmsUsageError):
        s.bind(None)


def test_bad_arguments(make_rig: RigMaker) -> None:
    """A bad hook mode, a backend without a CPU backup, CPU and disk together: ValueErrors, as in TMS."""
    rig = make_rig("cuda_like", capacity=64 * MiB)
    s = saver(rig)
    with pytest.raises(ValueError, match="hook_mode"):
        s.hook_mode = "ld_preload"
    with pytest.raises(ValueError, match="requires enable_cpu_backup=True"), s.region("w", cpu_backup_backend="mmap"):
        pass
    with (
        pytest.raises(ValueError, match="mutually exclusive"),
        s.region("w", enable_cpu_backup=True, enable_disk_backup=True),
    ):
        pass
    with pytest.raises(ValueError, match="memory_margin_bytes"):
        s.memory_margin_bytes = -1


def test_set_disk_backup_dir_creates_it(tmp_path: Path, make_rig: RigMaker) -> None:
    """set_disk_backup_dir creates the directory, as TMS does."""
    rig = make_rig("cuda_like", capacity=64 * MiB)
    s = saver(rig)
    target = tmp_path / "a" / "b"
    s.set_disk_backup_dir(str(target))
    assert target.is_dir()


def test_get_cpu_backup_refuses_a_host_tensor(make_rig: RigMaker) -> None:
    """get_cpu_backup takes a GPU tensor (TMS asserts it)."""
    torch = pytest.importorskip("torch")
    rig = make_rig("cuda_like", capacity=64 * MiB)
    s = saver(rig)
    with pytest.raises(TmsUsageError, match="on the GPU"):
        s.get_cpu_backup(torch.zeros(4))


def test_region_routes_allocations_and_pause_frees_them(make_rig: RigMaker) -> None:
    """Allocations inside region() are the tag's; pause frees them, resume maps them back at the same address."""
    rig = make_rig("cuda_like", capacity=64 * MiB)
    s = saver(rig)
    with s.region("weights", enable_cpu_backup=True):
        w = rig.allocator.allocate(2 << 20)
    rig.allocator.write(w, b"\x5a" * 64)
    s.pause("weights")
    assert rig.allocator.usage()["weights"].resident == 0
    s.resume("weights")
    assert rig.allocator.usage()["weights"].resident == 2 << 20
    assert rig.allocator.read(w, 64) == b"\x5a" * 64


class FakeCudaTensor:
    """Just enough of a CUDA tensor for get_cpu_backup, over an address of the simulated device."""

    is_cuda = True
    shape = (1024,)

    def __init__(self, alloc: TaggedAllocator, address: int) -> None:
        import torch

        self.alloc, self.address, self.dtype = alloc, address, torch.float32
        self.nbytes = 4096

    def data_ptr(self) -> int:
        return self.address

    def is_contiguous(self) -> bool:
        return True

    def stride(self) -> tuple[int, ...]:
        return (1,)

    def detach(self) -> FakeCudaTensor:
        return self

    def to(self, device: str) -> object:
        import torch

        raw = bytearray(self.alloc.read(self.address, self.nbytes))
        return torch.frombuffer(raw, dtype=torch.float32)


def test_get_cpu_backup_reads_the_pause_backup(make_rig: RigMaker) -> None:
    """While paused, get_cpu_backup gives the bytes as they were (copy and zero-copy); after a resume without retain, None."""
    torch = pytest.importorskip("torch")
    rig = make_rig("cuda_like", capacity=64 * MiB)
    s = saver(rig)
    with s.region("weights", enable_cpu_backup=True):
        w = rig.allocator.allocate(2 << 20)
    ref = torch.arange(1024, dtype=torch.float32)
    rig.allocator.write(w, ref.numpy().tobytes())
    x = FakeCudaTensor(rig.allocator, w)
    assert s.get_cpu_backup(x) is None  # awake, never paused
    s.pause("weights")
    assert torch.equal(s.get_cpu_backup(x), ref)
    assert torch.equal(s.get_cpu_backup(x, zero_copy=True), ref)
    s.resume("weights")
    assert s.get_cpu_backup(x) is None
    s.retain_cpu_backup = True  # too late: the resume freed the backup (TMS: None)
    assert s.get_cpu_backup(x) is None


def test_get_cpu_backup_of_a_discarded_region_and_of_foreign_memory(make_rig: RigMaker) -> None:
    """A region without backup gives None; memory no region holds is an error (TMS exits)."""
    pytest.importorskip("torch")
    rig = make_rig("cuda_like", capacity=64 * MiB)
    s = saver(rig)
    with s.region("kv_cache"):
        kv = rig.allocator.allocate(2 << 20)
    other = rig.allocator.allocate(2 << 20, tag="elsewhere")
    s.pause("kv_cache")
    assert s.get_cpu_backup(FakeCudaTensor(rig.allocator, kv)) is None
    with pytest.raises(TmsUsageError, match="no region of the saver"):
        s.get_cpu_backup(FakeCudaTensor(rig.allocator, other))
