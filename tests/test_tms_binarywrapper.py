"""torpor.tms.binarywrapper: TMS's C entry points in torpor's preload library, and the callbacks into torpor."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from torpor.tms.binarywrapper import SIGNATURES, BinaryWrapper, load

SOURCE = Path(__file__).resolve().parent.parent / "torpor" / "tms" / "csrc" / "tms_preload.c"


def compiled(tmp_path: Path) -> Path:
    """The preload library built from source into ``tmp_path`` (its own C state)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / "libtorpor_torch_memory_saver_preload.so"
    cmd = [cc, "-std=gnu11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror"]
    subprocess.run([*cmd, "-o", str(out), str(SOURCE), "-ldl", "-lpthread"], check=True, timeout=120)
    return out


def wrapper(tmp_path: Path) -> BinaryWrapper:
    """A wrapper over a fresh build of the library."""
    found = load(compiled(tmp_path))
    assert found is not None
    return found


def test_the_library_exports_every_tms_entry_point(tmp_path: Path) -> None:
    """tms_pause, tms_resume, tms_get_cpu_backup_pointer, the tms_set_/tms_get_ pairs and set_memory_margin_bytes are defined."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(compiled(tmp_path))], capture_output=True, text=True, check=True
    )
    names = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
    assert {n for n in SIGNATURES if not n.startswith("tmsp_")} <= names


def test_initial_settings_come_from_the_tms_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread's first settings are TMS_INIT_ENABLE, TMS_INIT_ENABLE_CPU_BACKUP, TMS_INIT_CPU_BACKUP_BACKEND, tag default."""
    monkeypatch.setenv("TMS_INIT_ENABLE", "1")
    monkeypatch.setenv("TMS_INIT_ENABLE_CPU_BACKUP", "1")
    monkeypatch.setenv("TMS_INIT_CPU_BACKUP_BACKEND", "mmap")
    monkeypatch.setenv("TMS_RETAIN_CPU_BACKUP", "1")
    c = wrapper(tmp_path).cdll
    got = (c.tms_get_interesting_region(), c.tms_get_enable_cpu_backup(), c.tms_get_cpu_backup_backend())
    assert got == (True, True, b"mmap")
    assert (c.tms_get_current_tag(), c.tms_get_retain_cpu_backup()) == (b"default", True)


def test_set_config_and_config_round_trip(tmp_path: Path) -> None:
    """set_config sets this thread's settings (a backend of None keeps the current one) and config() reads them back."""
    w = wrapper(tmp_path)
    w.set_config(tag="kv", interesting_region=True, enable_cpu_backup=True, cpu_backup_backend="mmap")
    w.set_config(tag="kv2", interesting_region=True, enable_cpu_backup=False, enable_disk_backup=True)
    assert w.config() == {
        "tag": "kv2",
        "interesting_region": True,
        "enable_cpu_backup": False,
        "cpu_backup_backend": "mmap",
        "enable_disk_backup": True,
    }


def test_tms_pause_and_resume_from_c_call_the_registered_callback(tmp_path: Path) -> None:
    """tms_pause(NULL) and tms_resume("w") reach what register() installed; a failing callback returns 1."""
    w = wrapper(tmp_path)
    calls: list[tuple[str, str | None]] = []
    w.register(lambda op, tag: calls.append((op, tag)), lambda a, n: a + 7)
    assert (w.cdll.tms_pause(None), w.cdll.tms_resume(b"w")) == (0, 0)
    assert calls == [("pause", None), ("resume", "w")]
    ptr = w.cdll.tms_get_cpu_backup_pointer(ctypes.cast(ctypes.c_void_p(0x1000), ctypes.POINTER(ctypes.c_uint8)), 8)
    assert ctypes.cast(ptr, ctypes.c_void_p).value == 0x1007

    def boom(op: str, tag: str | None) -> None:
        raise RuntimeError(op)

    w.register(boom, lambda a, n: None)
    assert w.cdll.tms_pause(None) == 1


def test_without_a_callback_tms_pause_says_so(tmp_path: Path) -> None:
    """Before torpor.tms registered, tms_pause returns 1 (nothing paused) instead of crashing."""
    assert wrapper(tmp_path).cdll.tms_pause(None) == 1


def test_disk_dir_and_margin_are_kept_in_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk directory is TMS_DISK_BACKUP_DIR until set; set_memory_margin_bytes is read back."""
    monkeypatch.setenv("TMS_DISK_BACKUP_DIR", "/var/tmp/x")
    w = wrapper(tmp_path)
    assert w.disk_backup_dir() == "/var/tmp/x"
    w.cdll.tms_set_disk_backup_dir(b"/data/spill")
    w.cdll.set_memory_margin_bytes(1 << 30)
    assert (w.disk_backup_dir(), w.cdll.tmsp_get_memory_margin_bytes()) == ("/data/spill", 1 << 30)


def test_cuda_runtime_names_fall_back_to_the_process(tmp_path: Path) -> None:
    """A name the library lacks resolves in the process (TMS's cdll links the CUDA runtime); a missing one says so."""
    c = wrapper(tmp_path).cdll
    assert c.getpid() == os.getpid()  # any global symbol: the CUDA runtime's on a GPU
    with pytest.raises(AttributeError, match="define no"):
        _ = c.no_such_entry_point_anywhere
