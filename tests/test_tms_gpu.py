"""GPU scenarios of torch_memory_saver's own examples, in torpor's words, each in a spawned process (scripts/gpu-suite).

Each test runs one scenario function of this module in a fresh ``spawn``
process (a crash or a leak in one cannot hide another, as TMS's
test_examples.py does), through ``torpor.tms``'s singleton exactly as a TMS
user calls it, and checks what the user would: the same addresses after a
resume, the device bytes a pause gives back (``cudaMemGetInfo`` deltas and
torpor's own table), and contents poisoned before the resume where a backup
must bring them back.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from torpor.units import GiB, MiB

pytestmark = pytest.mark.gpu

HOOK_MODES = ("torch", "preload")


def mode_env(hook_mode: str) -> dict[str, str]:
    """What a process of ``hook_mode`` starts with: preload mode has torpor's library on LD_PRELOAD when it is built."""
    from torpor.tms.preload import preload_library

    lib = preload_library()
    return {"LD_PRELOAD": str(lib)} if hook_mode == "preload" and lib is not None else {}


def in_fresh_process(fn: Callable[..., None], *args: object, env: dict[str, str] | None = None) -> None:
    """Run ``fn(*args)`` in a spawned process with ``env`` added; fail unless it exits 0."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        proc = mp.get_context("spawn").Process(target=fn, args=args)
        proc.start()
        proc.join(timeout=240)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if proc.is_alive():
        proc.kill()
        pytest.fail(f"{fn.__name__}{args} did not finish in 240 s")
    assert proc.exitcode == 0, f"{fn.__name__}{args} exited with {proc.exitcode} (its output is above)"


def _free() -> int:
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _saver(hook_mode: str):  # type: ignore[no-untyped-def]
    from torpor.tms import torch_memory_saver

    torch_memory_saver.hook_mode = hook_mode
    return torch_memory_saver


# -- scenarios (each runs in its own process) -------------------------------------------------------


def scenario_simple(hook_mode: str) -> None:
    """A 1 GiB region: pause gives back >= 90 % of it, resume maps it at the same address; twice."""
    import torch

    tms = _saver(hook_mode)
    with tms.region():
        x = torch.full((GiB // 4,), 7.0, device="cuda")
    ptr, nbytes = x.data_ptr(), x.nbytes
    for _ in range(2):
        before = _free()
        tms.pause()
        freed = _free() - before
        assert freed >= 0.9 * nbytes, f"pause freed {freed} of {nbytes} bytes"
        usage = tms._impl.allocator.usage()["default"]
        assert usage.resident == 0, usage
        tms.resume()
        assert x.data_ptr() == ptr
        assert _free() <= before + 0.1 * nbytes
        x.fill_(3.0)  # mapped fresh (no backup): writable and readable at the same address
        torch.cuda.synchronize()
        assert float(x[-1]) == 3.0


def scenario_kv_cache_and_graph(hook_mode: str) -> None:
    """A kv_cache region and a graph captured through cuda_graph(): both paused, both resumed, the graph replays."""
    import torch

    tms = _saver(hook_mode)
    with tms.region(tag="kv_cache"):
        kv = torch.full((5, 100_000_000), 1.0, device="cuda")
    static_in = torch.zeros(5, device="cuda")
    holder: dict[str, torch.Tensor] = {}

    def fn() -> None:
        value = (static_in + kv.mean(dim=1)).mean()
        holder["out"] = (torch.ones(250_000_000, device="cuda") * value).mean()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(g, tag="graph"):
        fn()
    static_in.fill_(100)
    g.replay()
    assert float(holder["out"]) == 101.0
    kv_ptr = kv.data_ptr()
    before = _free()
    tms.pause("kv_cache")
    after_kv = _free()
    assert after_kv - before >= 0.9 * kv.nbytes
    tms.pause("graph")
    assert _free() >= after_kv
    other = torch.zeros(2 * GiB, dtype=torch.uint8, device="cuda")  # the freed room is usable
    del other
    torch.cuda.empty_cache()
    tms.resume("graph")
    tms.resume("kv_cache")
    assert kv.data_ptr() == kv_ptr
    kv.fill_(2.0)  # discarded: refilled, as an engine refills its cache
    static_in.fill_(200)
    g.replay()
    torch.cuda.synchronize()
    assert float(holder["out"]) == 202.0


def scenario_cpu_backup(hook_mode: str, backend: str, retain: bool) -> None:
    """Weights with a CPU backup come back bit for bit; get_cpu_backup reads the backup while paused."""
    import torch

    tms = _saver(hook_mode)
    tms.retain_cpu_backup = retain
    with tms.region(tag="weights", enable_cpu_backup=True, cpu_backup_backend=backend):
        w = torch.randn(64 * MiB // 4, device="cuda")
    with tms.region(tag="scratch"):
        scratch = torch.ones(64 * MiB // 4, device="cuda")
    ref = w.cpu()
    ptr = w.data_ptr()
    assert tms.get_cpu_backup(w) is None  # awake, nothing paused yet
    tms.pause()
    copy = tms.get_cpu_backup(w)
    assert copy is not None and torch.equal(copy, ref)
    view = tms.get_cpu_backup(w[: 1 << 20], zero_copy=True)
    assert torch.equal(view, ref[: 1 << 20])
    del view
    tms.resume()
    assert w.data_ptr() == ptr and torch.equal(w.cpu(), ref)
    after = tms.get_cpu_backup(w)
    assert (after is not None) == retain
    if retain:
        assert torch.equal(after, ref)
    scratch.fill_(0)


def scenario_disk_backup(hook_mode: str, directory: str) -> None:
    """A region with a disk backup: pause frees it, resume brings its bytes back."""
    import torch

    tms = _saver(hook_mode)
    tms.set_disk_backup_dir(directory)
    with tms.region(tag="weights", enable_disk_backup=True):
        w = torch.randn(256 * MiB // 4, device="cuda")
    ref = w.cpu()
    before = _free()
    tms.pause("weights")
    assert _free() - before >= 0.9 * w.nbytes
    w_ptr = w.data_ptr()
    tms.resume("weights")
    assert w.data_ptr() == w_ptr and torch.equal(w.cpu(), ref)


def scenario_nested_and_disable(hook_mode: str) -> None:
    """Nested regions: the inner one (no backup) is discarded, the outer (backup) kept; disable() is never paused."""
    import torch

    tms = _saver(hook_mode)
    with tms.region(tag="model", enable_cpu_backup=True):
        weight = torch.full((10_000_000,), 42.0, device="cuda")
        with tms.region(tag="grad_buffer"):
            grad = torch.full((10_000_000,), 99.0, device="cuda")
        with tms.disable():
            plain = torch.full((10_000_000,), 5.0, device="cuda")
    tms.pause()
    assert bool((plain == 5.0).all())  # readable while everything else is paused
    tms.resume()
    assert bool((weight == 42.0).all())
    grad.zero_()
    usage = tms._impl.allocator.usage()
    assert usage["grad_buffer"].resident and usage["model"].resident


def scenario_sglang_order(hook_mode: str) -> None:
    """SGLang's release order (kv_cache, weights, cuda_graph) and its reverse: weights intact, the graph exact."""
    import torch

    tms = _saver(hook_mode)
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(4096, 4096, device="cuda")
    with tms.region(tag="kv_cache"):
        kv = torch.zeros(256 * MiB // 4, device="cuda")
    x = torch.randn(8, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x @ w
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with tms.cuda_graph(cuda_graph=g, tag="cuda_graph"):
        y = x @ w
    g.replay()
    ref_y, ref_w = y.clone(), w.cpu()
    before = _free()
    for tag in ("kv_cache", "weights", "cuda_graph"):
        tms.pause(tag)
    assert _free() - before >= 0.9 * (w.nbytes + kv.nbytes)
    for tag in ("cuda_graph", "weights", "kv_cache"):
        tms.resume(tag)
    assert torch.equal(w.cpu(), ref_w)  # TMS #71: weights corrupted across pause/resume; not here
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, ref_y)
    kv.fill_(1)
    controllers = tms._impl.controllers
    for tag in ("kv_cache", "weights", "cuda_graph"):
        kinds = [e.kind.value for e in controllers[tag].events()]
        assert "sleep_completed" in kinds and "wake_completed" in kinds, (tag, kinds)
        assert controllers[tag].state.value == "awake"


def _runtime():  # type: ignore[no-untyped-def]
    """cudaMalloc, cudaMemcpy and cudaFree as a ctypes user reaches them: the process's global scope (LD_PRELOAD first)."""
    import ctypes

    api = ctypes.CDLL(None)
    api.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    api.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    api.cudaFree.argtypes = [ctypes.c_void_p]
    return api


def _round_trip(api, ptr, value: int) -> int:  # type: ignore[no-untyped-def]
    import ctypes

    if value >= 0:
        byte = ctypes.c_ubyte(value)
        assert api.cudaMemcpy(ptr, ctypes.byref(byte), 1, 1) == 0  # host to device
    back = ctypes.c_ubyte()
    assert api.cudaMemcpy(ctypes.byref(back), ptr, 1, 2) == 0  # device to host
    return back.value


def scenario_raw_cuda_malloc() -> None:
    """Raw cudaMalloc of 6912 bytes (ctypes) inside a region is torpor's: backed up, restored; freed while paused."""
    import ctypes

    import torch

    tms = _saver("preload")
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    api = _runtime()
    kept, dropped = ctypes.c_void_p(), ctypes.c_void_p()
    with tms.region(tag="raw", enable_cpu_backup=True):
        assert api.cudaMalloc(ctypes.byref(kept), 6912) == 0
        assert api.cudaMalloc(ctypes.byref(dropped), 6912) == 0
    assert tms._impl.preload is not None, "torpor's preload library is not bound in this process"
    assert tms._impl.allocator.usage()["raw"].allocations == 2
    assert _round_trip(api, kept, 0xA5) == 0xA5
    tms.pause("raw")
    assert tms._impl.allocator.usage()["raw"].resident == 0
    assert api.cudaFree(dropped) == 0  # freed while paused: only its address range goes
    tms.resume("raw")
    assert _round_trip(api, kept, -1) == 0xA5  # the backup came back
    assert api.cudaFree(kept) == 0
    assert tms._impl.allocator.usage()["raw"].allocations == 0


def scenario_training_engine() -> None:
    """TMS_INIT_ENABLE=1 (+ CPU backup): torch's own segments outside any region are tagged, paused and restored."""
    import torch

    tms = _saver("preload")
    assert tms.retain_cpu_backup is False  # the saver's first call: torpor binds its table to the preload library
    torch.cuda.empty_cache()
    w = torch.full((256 * MiB // 4,), 42.0, device="cuda")  # a fresh segment: torch's cudaMalloc, now torpor's
    ptr = w.data_ptr()
    assert tms._impl.allocator.usage()["default"].resident >= w.nbytes
    before = _free()
    tms.pause()
    assert _free() - before >= 0.9 * w.nbytes
    tms.resume()
    assert w.data_ptr() == ptr and bool((w == 42.0).all())


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("hook_mode", HOOK_MODES)
def test_simple_region_pause_resume(hook_mode: str) -> None:
    """A region is paused with >= 90 % of its bytes given back and resumed at the same address."""
    in_fresh_process(scenario_simple, hook_mode, env=mode_env(hook_mode))


@pytest.mark.parametrize("hook_mode", HOOK_MODES)
def test_kv_cache_and_cuda_graph(hook_mode: str) -> None:
    """A kv_cache region and a graph captured through cuda_graph() replay correctly after pause and resume."""
    in_fresh_process(scenario_kv_cache_and_graph, hook_mode, env=mode_env(hook_mode))


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("backend", ["pinned", "mmap"])
@pytest.mark.parametrize("hook_mode", HOOK_MODES)
def test_cpu_backup(hook_mode: str, backend: str, retain: bool) -> None:
    """A CPU-backed region comes back bit for bit, pinned and mmap, retained and not."""
    in_fresh_process(scenario_cpu_backup, hook_mode, backend, retain, env=mode_env(hook_mode))


@pytest.mark.parametrize("hook_mode", HOOK_MODES)
def test_disk_backup(hook_mode: str) -> None:
    """A disk-backed region is freed by a pause and comes back bit for bit."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as directory:
        in_fresh_process(scenario_disk_backup, hook_mode, directory, env=mode_env(hook_mode))


@pytest.mark.parametrize("hook_mode", HOOK_MODES)
def test_nested_regions_and_disable(hook_mode: str) -> None:
    """Nested regions pause by their own settings; memory under disable() is never paused."""
    in_fresh_process(scenario_nested_and_disable, hook_mode, env=mode_env(hook_mode))


@pytest.mark.parametrize("hook_mode", HOOK_MODES)
def test_sglang_release_order(hook_mode: str) -> None:
    """kv_cache, weights, cuda_graph paused in SGLang's order and resumed in reverse: every tag logged, all intact."""
    in_fresh_process(scenario_sglang_order, hook_mode, env=mode_env(hook_mode))


def _preload_env(**extra: str) -> dict[str, str]:
    from torpor.tms.preload import preload_library

    lib = preload_library()
    if lib is None:
        pytest.skip("torpor's preload library is not built (pip install . or setup.py build_ext --inplace)")
    return {"LD_PRELOAD": str(lib), **extra}


def test_raw_cuda_malloc_freed_while_paused() -> None:
    """With torpor's preload library, raw cudaMalloc of 6912 bytes is tagged, restored, and can be freed while paused."""
    in_fresh_process(scenario_raw_cuda_malloc, env=_preload_env())


def test_training_engine_with_init_enable() -> None:
    """TMS_INIT_ENABLE=1 with a CPU backup: memory torch allocates outside any region is paused and restored."""
    env = _preload_env(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    in_fresh_process(scenario_training_engine, env=env)


def test_switch_runs_an_unmodified_tms_program(tmp_path: Path) -> None:
    """With TORPOR_TMS=1 an unmodified TMS program (import torch_memory_saver) pauses and resumes on torpor."""
    script = tmp_path / "tms_user.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch_memory_saver import torch_memory_saver
            assert type(torch_memory_saver).__module__ == "torpor.tms.saver"
            with torch_memory_saver.region(tag="kv_cache"):
                kv = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
            with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
                w = torch.randn(1 << 20, device="cuda")
            ref = w.cpu()
            torch_memory_saver.pause()
            torch_memory_saver.resume()
            assert torch.equal(w.cpu(), ref)
            print("OK")
            """
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "torpor.tms.tmsrun", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
