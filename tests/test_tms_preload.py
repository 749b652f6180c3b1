"""configure_subprocess(): LD_PRELOAD composed as TMS composes it, restored after, unchanged while the library is not built."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torpor.allocator import SimDriver, TaggedAllocator
from torpor.tms import preload
from torpor.tms.envsettings import TmsSettings
from torpor.tms.pausing import TmsEngine
from torpor.tms.preload import PRELOAD_NAME, PreloadHook, configure_subprocess, prepended


def test_prepended_as_tms() -> None:
    """The library goes first, the old value after a colon; alone when there was none."""
    assert prepended("", "/x/lib.so") == "/x/lib.so"
    assert prepended("/other.so", "/x/lib.so") == "/x/lib.so:/other.so"


def test_the_library_name_says_torch_memory_saver() -> None:
    """Code that looks for 'torch_memory_saver' on LD_PRELOAD (TMS's own check) finds torpor's library."""
    assert "torch_memory_saver" in PRELOAD_NAME


@pytest.mark.parametrize("initial", [None, "/other/lib.so"])
def test_configure_subprocess_sets_and_restores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, initial: str | None
) -> None:
    """Inside the block LD_PRELOAD starts with torpor's library and keeps what was there; after it, as before."""
    lib = tmp_path / PRELOAD_NAME
    lib.write_bytes(b"")
    monkeypatch.setattr(preload, "preload_library", lambda: lib)
    if initial is None:
        monkeypatch.delenv("LD_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("LD_PRELOAD", initial)
    with configure_subprocess():
        parts = os.environ["LD_PRELOAD"].split(":")
        assert parts[0] == str(lib)
        assert parts[1:] == ([] if initial is None else [initial])
    assert os.environ.get("LD_PRELOAD") == initial


def test_without_the_library_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no preload library built, the block leaves LD_PRELOAD as it was."""
    monkeypatch.setattr(preload, "preload_library", lambda: None)
    monkeypatch.setenv("LD_PRELOAD", "/keep.so")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == "/keep.so"


SOURCE = Path(__file__).resolve().parent.parent / "torpor" / "tms" / "csrc" / "tms_preload.c"


def built(tmp_path: Path) -> Path:
    """The preload library compiled from source into ``tmp_path`` (its own copy: its bind state is its own)."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / PRELOAD_NAME
    cmd = [cc, "-std=gnu11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror"]
    subprocess.run([*cmd, "-o", str(out), str(SOURCE), "-ldl", "-lpthread"], check=True, timeout=120)
    return out


def hooked(tmp_path: Path) -> tuple[TmsEngine, ctypes.CDLL]:
    """A preload-mode engine on the simulated device with the library bound to its table."""
    lib = preload.load(built(tmp_path))
    engine = TmsEngine(
        "preload", allocator=TaggedAllocator(SimDriver(64 << 20)), settings=TmsSettings(), telemetry=False
    )
    engine.preload = PreloadHook(lib, engine.allocator.native_entry)
    return engine, lib


def test_the_library_exports_cuda_malloc_and_free(tmp_path: Path) -> None:
    """The library defines cudaMalloc and cudaFree (what LD_PRELOAD interposes) and nothing of CUDA's else."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(built(tmp_path))], capture_output=True, text=True, check=True
    )
    names = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
    assert {"cudaMalloc", "cudaFree"} <= names
    assert {n for n in names if n.startswith("cuda")} == {"cudaMalloc", "cudaFree"}


def test_raw_cuda_malloc_in_a_region_is_tagged_and_freed_while_paused(tmp_path: Path) -> None:
    """6912 bytes of raw cudaMalloc inside region('raw') land in torpor's table; a pause frees them; cudaFree works paused."""
    engine, lib = hooked(tmp_path)
    ptr = ctypes.c_void_p()
    with engine.region("raw", False, False, None):
        assert lib.cudaMalloc(ctypes.byref(ptr), 6912) == 0
    usage = engine.allocator.usage()["raw"]
    assert (usage.allocations, usage.resident > 0) == (1, True)
    assert engine.preload is not None and engine.preload.live() == 1
    engine.pause("raw")
    assert engine.allocator.usage()["raw"].resident == 0
    assert lib.cudaFree(ptr) == 0  # freed while paused: only the address range goes
    assert engine.preload.live() == 0
    engine.resume("raw")
    assert engine.allocator.usage()["raw"].allocations == 0


def test_cuda_free_of_torpors_memory_waits_for_the_device_before_it_unmaps(tmp_path: Path) -> None:
    """cudaFree of a tagged segment synchronizes the device before the unmap, as cudaFree does (TMS's free too)."""
    engine, lib = hooked(tmp_path)
    ptr = ctypes.c_void_p()
    with engine.region("raw", False, False, None):
        assert lib.cudaMalloc(ctypes.byref(ptr), 3 << 20) == 0
    driver = engine.allocator.driver
    before = len(driver.calls)
    assert lib.cudaFree(ptr) == 0
    calls = [c.call for c in driver.calls[before:]]
    assert "synchronize" in calls and "unmap" in calls, calls
    assert calls.index("synchronize") < calls.index("unmap"), calls


def test_a_cuda_free_whose_synchronize_fails_keeps_the_memory_mapped_and_says_so(tmp_path: Path) -> None:
    """A failed synchronize at cudaFree returns an error and leaves the segment mapped; the next pause unmaps it."""
    engine, lib = hooked(tmp_path)
    ptr = ctypes.c_void_p()
    with engine.region("raw", True, False, None):
        assert lib.cudaMalloc(ctypes.byref(ptr), 3 << 20) == 0
    driver = engine.allocator.driver
    assert ptr.value is not None
    driver.fail("synchronize", reason="an illegal memory access was encountered")
    assert lib.cudaFree(ptr) != 0
    assert any(s <= ptr.value < s + n for s, n in driver.mapped_ranges())
    assert engine.preload is not None and engine.preload.live() == 0
    assert any("illegal memory access" in str(err) for err in engine.allocator.pending_errors())
    engine.pause("raw")
    assert not any(s <= ptr.value < s + n for s, n in driver.mapped_ranges())
    engine.resume("raw")
    assert engine.allocator.usage()["raw"].allocations == 0


def test_thread_tags_follow_regions_and_disable(tmp_path: Path) -> None:
    """A region sets this thread's tag, disable() turns it off, leaving restores what was there."""
    engine, lib = hooked(tmp_path)
    assert lib.tmsp_get_tag() == preload.INHERIT
    with engine.region("w", True, False, None):
        inside = lib.tmsp_get_tag()
        assert inside == engine.allocator.native_entry.tag_id("w")
        with engine.disable():
            assert lib.tmsp_get_tag() == preload.OFF
        assert lib.tmsp_get_tag() == inside
    assert lib.tmsp_get_tag() == preload.INHERIT


def test_init_enable_tags_allocations_outside_regions(tmp_path: Path) -> None:
    """With a process default (TMS_INIT_ENABLE=1) raw cudaMalloc outside any region goes to that tag."""
    engine, lib = hooked(tmp_path)
    assert engine.preload is not None
    engine.preload.set_default("default")
    engine.allocator.tag_state("default")
    ptr = ctypes.c_void_p()
    assert lib.cudaMalloc(ctypes.byref(ptr), 1 << 20) == 0
    assert engine.allocator.usage()["default"].allocations == 1
    assert lib.cudaFree(ptr) == 0
    engine.preload.set_default(None)


def test_preloaded_reads_ld_preload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """preloaded() gives nothing when LD_PRELOAD does not name the library (where it does: the subprocess tests below)."""
    lib = built(tmp_path)
    monkeypatch.setattr(preload, "preload_library", lambda: lib)
    assert preload.preloaded({"LD_PRELOAD": "/other.so"}) is None
    assert preload.preloaded({}) is None


def test_raw_cuda_malloc_with_a_cpu_backup_comes_back(tmp_path: Path) -> None:
    """Raw cudaMalloc memory of a region with a CPU backup holds its bytes across pause and resume."""
    engine, lib = hooked(tmp_path)
    ptr = ctypes.c_void_p()
    with engine.region("raw", True, False, None):
        assert lib.cudaMalloc(ctypes.byref(ptr), 6912) == 0
    assert ptr.value is not None
    engine.allocator.write(ptr.value, b"\xa5" * 6912)
    engine.pause("raw")
    engine.resume("raw")
    assert engine.allocator.read(ptr.value, 6912) == b"\xa5" * 6912
    assert lib.cudaFree(ptr) == 0


def test_on_ld_preload_the_engine_binds_and_raw_calls_reach_the_table(tmp_path: Path) -> None:
    """In a process started with the library on LD_PRELOAD, cudaMalloc found by name (ctypes.CDLL(None)) is torpor's."""
    lib = built(tmp_path)
    code = (
        "import ctypes\n"
        "from torpor.allocator import SimDriver, TaggedAllocator\n"
        "from torpor.tms import preload\n"
        "from torpor.tms.pausing import TmsEngine\n"
        "from torpor.tms.envsettings import TmsSettings\n"
        f"preload.preload_library = lambda: preload.Path({str(lib)!r})\n"
        "e = TmsEngine('preload', allocator=TaggedAllocator(SimDriver(64 << 20)), settings=TmsSettings(), telemetry=False)\n"
        "api = ctypes.CDLL(None)\n"
        "api.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]\n"
        "api.cudaFree.argtypes = [ctypes.c_void_p]\n"
        "p = ctypes.c_void_p()\n"
        "with e.region('raw', False, False, None):\n"
        "    rc = api.cudaMalloc(ctypes.byref(p), 6912)\n"
        "print('BOUND', e.preload is not None, 'RC', rc, 'ALLOCS', e.allocator.usage()['raw'].allocations)\n"
        "e.pause('raw')\n"
        "print('FREE', api.cudaFree(p), 'LIVE', e.preload.live())\n"
    )
    env = {**os.environ, "LD_PRELOAD": str(lib)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "BOUND True RC 0 ALLOCS 1" in out.stdout
    assert "FREE 0 LIVE 0" in out.stdout


INTERPOSER = """
#include <stddef.h>
int cudaMalloc(void **ptr, size_t n) { (void)n; *ptr = (void *)0; return 2; }
int cudaFree(void *ptr) { (void)ptr; return 0; }
"""

SHADOW_PROBE = (
    "import ctypes, logging\n"
    "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
    "from torpor.allocator import SimDriver, TaggedAllocator\n"
    "from torpor.tms import preload\n"
    "from torpor.tms.pausing import TmsEngine\n"
    "from torpor.tms.envsettings import TmsSettings\n"
    "preload.preload_library = lambda: preload.Path({lib!r})\n"
    "e = TmsEngine('preload', allocator=TaggedAllocator(SimDriver(64 << 20)), settings=TmsSettings(), telemetry=False)\n"
    "print('BOUND', e.preload is not None)\n"
)


def interposer(tmp_path: Path) -> Path:
    """Another library that defines cudaMalloc and cudaFree (another tool's interposer), compiled into ``tmp_path``."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "other_interposer.c"
    src.write_text(INTERPOSER)
    out = tmp_path / "other_interposer.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, timeout=120)
    return out


def test_a_shadowed_preload_library_is_reported_not_bound(tmp_path: Path) -> None:
    """With another interposer first on LD_PRELOAD, cudaMalloc resolves to it: the hook is not bound, a warning names the winner."""
    lib = built(tmp_path)
    other = interposer(tmp_path)
    env = {**os.environ, "LD_PRELOAD": f"{other}:{lib}"}
    out = subprocess.run(
        [sys.executable, "-c", SHADOW_PROBE.format(lib=str(lib))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "BOUND False" in out.stdout
    warnings = [line for line in out.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, out.stderr
    assert f"cudaMalloc resolves to {other}" in warnings[0]
    assert "shadows" in warnings[0]
    assert "goes to torpor's table" not in out.stderr


def test_torpors_library_first_is_bound(tmp_path: Path) -> None:
    """With torpor's library first and another interposer after it, cudaMalloc is torpor's: the hook is bound, no warning."""
    lib = built(tmp_path)
    other = interposer(tmp_path)
    env = {**os.environ, "LD_PRELOAD": f"{lib}:{other}"}
    out = subprocess.run(
        [sys.executable, "-c", SHADOW_PROBE.format(lib=str(lib))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "BOUND True" in out.stdout
    assert "WARNING" not in out.stderr


def test_a_library_named_but_not_preloaded_is_not_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LD_PRELOAD naming torpor's library in a process that did not start with it: not bound, and said."""
    lib = built(tmp_path)
    monkeypatch.setattr(preload, "preload_library", lambda: lib)
    with caplog.at_level("WARNING", logger="torpor.tms"):
        assert preload.preloaded({"LD_PRELOAD": f"/other.so:{lib}"}) is None
    assert "was not preloaded into this process" in caplog.text
