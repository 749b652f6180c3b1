"""Sleep/wake benchmark harness: torpor, a vLLM-style baseline and torch_memory_saver side by side, against the host-link floor.

Runs on a CUDA machine (``torpor bench``). For each workload and system it
records first and later sleep, wake, device bytes released, pinned host bytes
held, bit-exactness, and each time as a ratio to the floor measured in the same
run (bytes over the measured pinned-copy bandwidth). The baseline copies each
allocation synchronously into pinned memory taken from torch's pinned-memory
cache, as vLLM's CuMemAllocator does (written here from that description).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from torpor.allocator.offload import HostPolicy
from torpor.allocator.tagged import TaggedAllocator
from torpor.statemachine.policy import HostMemoryPolicy, Policy

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Result:
    """One system on one workload."""

    system: str
    workload: str
    nbytes: int
    segments: int
    sleeps: list[float] = field(default_factory=list)
    wakes: list[float] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    host_held: int = 0
    exact: bool = True
    prepare_s: float = 0.0
    note: str = ""
    host_mode: str = ""
    pinned_awake: int = 0  # before the first sleep (after pinning ahead, when on)
    pinned_asleep: int = 0
    pinned_after_wake: int = 0  # once a release after wake is done

    def row(self, floor_d2h: float, floor_h2d: float) -> dict[str, Any]:
        """A table row: times and their ratio to the floor."""
        later_s = statistics.median(self.sleeps[1:]) if len(self.sleeps) > 1 else float("nan")
        wake_s = (
            statistics.median(self.wakes[1:])
            if len(self.wakes) > 1
            else (self.wakes[0] if self.wakes else float("nan"))
        )
        fs = self.nbytes / floor_d2h
        fw = self.nbytes / floor_h2d
        return {
            "system": self.system,
            "workload": self.workload,
            "GiB": self.nbytes / GiB,
            "segments": self.segments,
            "first_sleep_s": self.sleeps[0] if self.sleeps else float("nan"),
            "later_sleep_s": later_s,
            "wake_s": wake_s,
            "first_x": (self.sleeps[0] / fs) if self.sleeps else float("nan"),
            "later_x": later_s / fs,
            "wake_x": wake_s / fw,
            "released_pct": 100.0 * min(self.released or [0]) / self.nbytes if self.nbytes else 0.0,
            "host_GiB": self.host_held / GiB,
            "exact": self.exact,
            "prepare_s": self.prepare_s,
            "note": self.note,
            "host_mode": self.host_mode,
            "pinned_awake_GiB": self.pinned_awake / GiB,
            "pinned_asleep_GiB": self.pinned_asleep / GiB,
            "pinned_after_wake_GiB": self.pinned_after_wake / GiB,
        }


class _Raw:
    """A device range as a torch tensor, through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _tensor(ptr: int, nbytes: int) -> Any:
    import torch

    return torch.as_tensor(_Raw(ptr, nbytes), device="cuda")


def _free_device() -> int:
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def measure_floor(nbytes: int = 2 * GiB, repeats: int = 5) -> tuple[float, float]:
    """Pinned copy bandwidth (bytes/s) device-to-host and host-to-device, best of ``repeats``."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for src, dst in ((dev, host), (host, dev)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out.append(nbytes / best)
    del dev, host
    torch.cuda.empty_cache()
    return out[0], out[1]


def _fill(ranges: list[tuple[int, int]]) -> list[Any]:
    """Fill each range with random bytes; return device clones to compare with after a wake."""
    refs = []
    for ptr, n in ranges:
        t = _tensor(ptr, n)
        t.random_(0, 256)
        refs.append(t.clone())
    return refs


def _same(ranges: list[tuple[int, int]], refs: list[Any]) -> bool:
    import torch

    return all(bool(torch.equal(_tensor(p, n), r)) for (p, n), r in zip(ranges, refs, strict=True))


# -- torpor -------------------------------------------------------------------------------


def run_torpor_raw(
    name: str,
    segments: int,
    seg_bytes: int,
    cycles: int,
    alloc: TaggedAllocator | None = None,
    host: HostMemoryPolicy | None = None,
) -> Result:
    """Allocate ``segments`` x ``seg_bytes`` under ``weights``; sleep level 1 and wake ``cycles`` times.

    ``host``: the host-memory policy (default: pin at the first sleep, keep
    after wake). With pinning ahead the first sleep waits for it to finish.
    """
    from torpor import SleepController

    own = alloc is None
    alloc = alloc or TaggedAllocator()
    host = host or HostMemoryPolicy()
    ctl = SleepController(alloc, policy=Policy(host=host))
    t0 = time.perf_counter()
    ranges = [(alloc.allocate(seg_bytes, "weights"), seg_bytes) for _ in range(segments)]
    refs = _fill(ranges)
    ready = alloc.wait_host_ready(600)
    res = Result("torpor", name, segments * seg_bytes, segments, prepare_s=time.perf_counter() - t0)
    res.host_mode = f"{host.pin.value}, {host.after_wake.value}"
    res.pinned_awake = alloc.pinned_bytes()
    if not ready:
        res.note = "pin-ahead did not finish"
    for _ in range(cycles):
        before = _free_device()
        t = time.perf_counter()
        ctl.sleep(1)
        res.sleeps.append(time.perf_counter() - t)
        res.released.append(_free_device() - before)
        res.host_held = res.pinned_asleep = alloc.pinned_bytes()
        t = time.perf_counter()
        ctl.wake()
        res.wakes.append(time.perf_counter() - t)
        alloc.host.wait_unpinned(60)
        res.pinned_after_wake = alloc.pinned_bytes()
        res.exact = res.exact and _same(ranges, refs)
    del refs
    for ptr, _ in ranges:
        alloc.free(ptr)
    if own:
        alloc.close()
    return res


# -- the vLLM-style baseline -----------------------------------------------------------------


class VllmStyle:
    """Per allocation: its own reservation and handle; sleep copies each synchronously to fresh pinned memory."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self.cu = cu
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = 0
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = 0
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.desc = [desc]
        self.allocs: list[list[Any]] = []  # [ptr, size, handle, backup tensor]

    def _ok(self, result: Any) -> Any:
        if result[0] != self.cu.CUresult.CUDA_SUCCESS:
            msg = f"baseline driver call failed: {result[0]}"
            raise RuntimeError(msg)
        return result[1] if len(result) > 1 else None

    def _map(self, ptr: int, size: int) -> Any:
        cu = self.cu
        handle = self._ok(cu.cuMemCreate(size, self.prop, 0))
        self._ok(cu.cuMemMap(ptr, size, 0, handle, 0))
        self._ok(cu.cuMemSetAccess(ptr, size, self.desc, 1))
        return handle

    def allocate(self, size: int) -> int:
        """Reserve, create, map and enable one allocation."""
        ptr = int(self._ok(self.cu.cuMemAddressReserve(size, 0, 0, 0)))
        self.allocs.append([ptr, size, self._map(ptr, size), None])
        return ptr

    def sleep(self) -> None:
        """Copy each allocation to pinned host memory (synchronously), then unmap and release it."""
        import torch

        cu = self.cu
        torch.cuda.synchronize()
        for a in self.allocs:
            ptr, size, handle, _ = a
            backup = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._ok(cu.cuMemcpyDtoH(backup.data_ptr(), ptr, size))
            a[3] = backup
            self._ok(cu.cuMemUnmap(ptr, size))
            self._ok(cu.cuMemRelease(handle))

    def wake(self) -> None:
        """Map each allocation again and copy its backup back (synchronously); drop the backup."""
        for a in self.allocs:
            ptr, size, _, backup = a
            a[2] = self._map(ptr, size)
            self._ok(self.cu.cuMemcpyHtoD(ptr, backup.data_ptr(), size))
            a[3] = None

    def close(self) -> None:
        """Unmap and free everything."""
        cu = self.cu
        for ptr, size, handle, _ in self.allocs:
            self._ok(cu.cuMemUnmap(ptr, size))
            self._ok(cu.cuMemRelease(handle))
            self._ok(cu.cuMemAddressFree(ptr, size))
        self.allocs.clear()


def run_baseline_raw(name: str, segments: int, seg_bytes: int, cycles: int, keep_host_cache: bool = False) -> Result:
    """The vLLM-style loop on ``segments`` x ``seg_bytes`` (torch's pinned cache emptied after, unless kept)."""
    import torch

    base = VllmStyle()
    ranges = [(base.allocate(seg_bytes), seg_bytes) for _ in range(segments)]
    refs = _fill(ranges)
    res = Result("vllm-style", name, segments * seg_bytes, segments)
    for _ in range(cycles):
        before = _free_device()
        t = time.perf_counter()
        base.sleep()
        res.sleeps.append(time.perf_counter() - t)
        res.released.append(_free_device() - before)
        res.host_held = sum(a[1] for a in base.allocs)
        t = time.perf_counter()
        base.wake()
        torch.cuda.synchronize()
        res.wakes.append(time.perf_counter() - t)
        res.exact = res.exact and _same(ranges, refs)
    del refs
    base.close()
    if not keep_host_cache:
        torch._C._host_emptyCache()
    return res


def run_tms_raw(name: str, segments: int, seg_bytes: int, cycles: int) -> Result:
    """torch_memory_saver with CPU backup, when importable (its wheel is not on the GPU image)."""
    import torch

    res = Result("torch_memory_saver", name, segments * seg_bytes, segments)
    try:
        from torch_memory_saver import torch_memory_saver as tms

        if not getattr(run_tms_raw, "configured", False):
            tms.hook_mode = "torch"  # its pluggable-allocator mode (no LD_PRELOAD); settable once per process
            run_tms_raw.configured = True  # type: ignore[attr-defined]
    except Exception as exc:  # not installed: reported, not fatal
        res.note = f"not importable ({type(exc).__name__})"
        res.exact = False
        return res
    res.note = "torch's caching allocator packs tensors < 10 MiB into 20 MiB segments"
    with tms.region(tag="bench", enable_cpu_backup=True):
        tensors = [torch.empty(seg_bytes, dtype=torch.uint8, device="cuda") for _ in range(segments)]
    for t in tensors:
        t.random_(0, 256)
    refs = [t.clone() for t in tensors]
    for _ in range(cycles):
        before = _free_device()
        t0 = time.perf_counter()
        tms.pause("bench")
        torch.cuda.synchronize()
        res.sleeps.append(time.perf_counter() - t0)
        res.released.append(_free_device() - before)
        t0 = time.perf_counter()
        tms.resume("bench")
        torch.cuda.synchronize()
        res.wakes.append(time.perf_counter() - t0)
        res.exact = res.exact and all(bool(torch.equal(a, b)) for a, b in zip(tensors, refs, strict=True))
    return res


# -- a real graph pool ------------------------------------------------------------------------


def run_torpor_graphs(cycles: int, batches: tuple[int, ...] = (1, 8, 32, 128), layers: int = 4) -> Result:
    """A small transformer encoder (weights tag) captured for several batch sizes into the cudagraph pool."""
    import torch

    from torpor import SleepController

    torch.manual_seed(0)
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    d = 1024
    t0 = time.perf_counter()
    with alloc.use_memory_pool("weights"):
        layer = torch.nn.TransformerEncoderLayer(d, 16, 4 * d, dropout=0.0, batch_first=True, device="cuda")
        model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    graphs = []
    with alloc.use_memory_pool("runtime"):
        inputs = {b: torch.randn(b, 64, d, device="cuda") for b in batches}
    with torch.no_grad():
        s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for b in batches:
                model(inputs[b])
        torch.cuda.current_stream().wait_stream(s)
        for b in batches:
            g = torch.cuda.CUDAGraph()
            with ctl.capture(f"encoder batch={b}") as cap, cap.graph(g):  # type: ignore[attr-defined]
                const = torch.empty(b, 64, d, device="cuda")
                out = model(inputs[b]) + const
            const.fill_(0.5)  # written once after capture, read by every replay
            graphs.append((g, out, const))  # const stays alive: dropped, the next capture would reuse its memory
    refs = []
    for g, out, _ in graphs:
        g.replay()
        torch.cuda.synchronize()
        refs.append(out.clone())
    deterministic = True
    for (g, out, _), ref in zip(graphs, refs, strict=True):  # control: a second replay before any sleep
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        deterministic = deterministic and bool(torch.equal(out, ref))
    alloc.wait_host_ready(600)
    usage = alloc.usage()
    tagged = sum(u.resident for u in usage.values())
    res = Result("torpor", "transformer graphs", tagged, sum(u.allocations for u in usage.values()))
    res.prepare_s = time.perf_counter() - t0
    res.note = (
        f"batches {list(batches)}; cudagraph {usage['cudagraph'].resident / MiB:.0f} MiB; "
        f"replay deterministic before sleep: {deterministic}"
    )
    for _ in range(cycles):
        before = _free_device()
        t = time.perf_counter()
        ctl.sleep(1)
        res.sleeps.append(time.perf_counter() - t)
        res.released.append(_free_device() - before)
        res.host_held = alloc.pinned_bytes()
        t = time.perf_counter()
        ctl.wake()
        res.wakes.append(time.perf_counter() - t)
        for (g, out, _), ref in zip(graphs, refs, strict=True):
            out.zero_()  # a replay must write it again
            g.replay()
            torch.cuda.synchronize()
            res.exact = res.exact and bool(torch.equal(out, ref))
    del graphs, refs, model, layer, inputs
    gc.collect()
    return res


# -- does pinning ahead slow the awake engine? ----------------------------------------------


def engine_step() -> Callable[[], float]:
    """A warmed-up engine-like step that returns its seconds: the awake work background pinning must not hold up.

    One step: a 16 MiB pinned input copy, a 4096x4096 bf16 matmul, 32 small
    kernels, synchronize.
    """
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(1 << 18, device="cuda")
    host_in = torch.randn(4 << 20, pin_memory=True)
    dev_in = torch.empty_like(host_in, device="cuda")

    def step() -> float:
        t = time.perf_counter()
        dev_in.copy_(host_in, non_blocking=True)
        torch.mm(a, a)
        for _ in range(32):
            small.add_(1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(50):
        step()
    return step


def measure_pinning_interference(pin_bytes: int = 8 * GiB, steps: int = 300) -> dict[str, Any]:
    """Step times of engine-like work (a bf16 matmul, 32 small kernels, a 16 MiB input copy) idle and during pinning.

    The background pinning thread competes with the engine for the driver and
    host memory bandwidth; this measures the step time (median and 99th
    percentile, each step synchronized) with no pinning, then while a
    :class:`HostArena` pins ``pin_bytes`` ahead, as after a model load.
    """
    from torpor.allocator.cuda_driver import CudaDriver
    from torpor.allocator.offload import HostArena

    step = engine_step()
    idle = [step() for _ in range(steps)]
    arena = HostArena(CudaDriver(), HostPolicy(prepin=True))
    t0 = time.perf_counter()
    arena.want(pin_bytes)
    busy: list[float] = []
    while not arena.wait_ready(0) or len(busy) < 20:
        busy.append(step())
        if time.perf_counter() - t0 > 120:
            break
    pin_s = time.perf_counter() - t0
    pinned = arena.pinned_bytes()
    arena.close()

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "pin_bytes": pinned,
        "pin_s": pin_s,
        "idle_steps": len(idle),
        "busy_steps": len(busy),
        "idle_median_ms": 1e3 * statistics.median(idle),
        "idle_p99_ms": 1e3 * pct(idle, 0.99),
        "busy_median_ms": 1e3 * statistics.median(busy),
        "busy_p99_ms": 1e3 * pct(busy, 0.99),
        "slowdown_median": statistics.median(busy) / statistics.median(idle),
    }


# -- the whole run ----------------------------------------------------------------------------


def run(
    cycles: int = 4,
    sweep: bool = True,
    tms: bool = True,
    log: Callable[[str], None] = print,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every workload on every system, plus the sweeps for the plots; returns a JSON-ready dict (``save``: after each part)."""
    import torch

    from torpor.allocator.cuda_driver import transparent_huge_pages

    d2h, h2d = measure_floor()
    log(f"floor: pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s")
    log(f"transparent huge pages: {transparent_huge_pages()}; {os.cpu_count()} CPUs")
    results: list[Result] = []
    main = [("8 GiB / 64", 64, 128 * MiB), ("4 GiB / 2048 x 2 MiB", 2048, 2 * MiB)]
    for name, n, size in main:
        for runner in (run_torpor_raw, run_baseline_raw) + ((run_tms_raw,) if tms else ()):
            r = runner(name, n, size, 2 if runner is run_tms_raw else cycles)
            results.append(r)
            log(_line(r.row(d2h, h2d)))
            gc.collect()
            torch.cuda.empty_cache()
    from torpor.allocator.bench_host import HOST_MODES, measure_pageable

    modes: list[Result] = []
    for name, n, size in main:
        for host in HOST_MODES:
            r = run_torpor_raw(name, n, size, 3, host=host)
            r.system = f"torpor ({r.host_mode})"
            modes.append(r)
            log(_line(r.row(d2h, h2d)) + f" pinned awake/asleep/after wake {_pins(r)}")
            gc.collect()
            torch.cuda.empty_cache()
    pageable = measure_pageable()
    log("pageable D2H: fresh {:.1f} GB/s, reused {:.1f} GB/s".format(*(v / 1e9 for v in pageable.values())))
    flat = TaggedAllocator(slab_bytes=0)
    r = run_torpor_raw("4 GiB / 2048 x 2 MiB", 2048, 2 * MiB, cycles, flat)
    r.system = "torpor (no slabs)"
    flat.close()
    results.append(r)
    log(_line(r.row(d2h, h2d)))
    r = run_torpor_graphs(cycles)
    results.append(r)
    log(_line(r.row(d2h, h2d)))
    gc.collect()
    torch.cuda.empty_cache()
    interference = measure_pinning_interference()
    log(
        "awake step while pinning {pin_bytes} B ahead ({pin_s:.1f} s): median {busy_median_ms:.3f} ms "
        "vs idle {idle_median_ms:.3f} ms ({slowdown_median:.2f}x), p99 {busy_p99_ms:.3f} vs {idle_p99_ms:.3f} ms "
        "({busy_steps} and {idle_steps} steps)".format(**interference)
    )
    sweeps: list[dict[str, Any]] = []

    def snapshot() -> dict[str, Any]:
        return {
            "machine": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "floor_d2h_Bps": d2h,
            "floor_h2d_Bps": h2d,
            "cycles": cycles,
            "rows": [r.row(d2h, h2d) for r in results],
            "raw": [asdict(r) for r in results],
            "sweeps": sweeps,
            "awake_interference": interference,
            "host_modes": [r.row(d2h, h2d) for r in modes],
            "pageable_d2h": pageable,
            "transparent_huge_pages": transparent_huge_pages(),
            "cpus": os.cpu_count(),
        }

    if save is not None:
        save(snapshot())
    if sweep:
        shared = TaggedAllocator()
        points = [("bytes", GiB * k // (128 * MiB), 128 * MiB) for k in (1, 2, 4, 8)]
        points += [("segments", n, 2 * GiB // n) for n in (16, 128, 1024)]
        for axis, n, size in points:
            r = run_torpor_raw(f"sweep {axis}", n, size, 3, shared)
            b = run_baseline_raw(f"sweep {axis}", n, size, 3, keep_host_cache=axis == "bytes")
            for res in (r, b):
                row = res.row(d2h, h2d)
                row["axis"] = axis
                sweeps.append(row)
                log(_line(row))
            gc.collect()
            torch.cuda.empty_cache()
        torch._C._host_emptyCache()
        shared.close()
    return snapshot()


def _pins(r: Result) -> str:
    return f"{r.pinned_awake / GiB:.2f}/{r.pinned_asleep / GiB:.2f}/{r.pinned_after_wake / GiB:.2f} GiB"


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['system']:<22} {row['workload']:<22} first {row['first_sleep_s']:.3f}s ({row['first_x']:.2f}x) "
        f"later {row['later_sleep_s']:.3f}s ({row['later_x']:.2f}x) wake {row['wake_s']:.3f}s ({row['wake_x']:.2f}x) "
        f"released {row['released_pct']:.2f}% host {row['host_GiB']:.2f} GiB exact {row['exact']} "
        f"prep {row['prepare_s']:.2f}s {row['note']}"
    )


def markdown(data: dict[str, Any]) -> str:
    """The results table in Markdown."""
    head = (
        "| system | workload | first sleep | later sleep | wake | released | host held | bit-exact |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = []
    for r in data["rows"]:
        if r["note"].startswith("not importable"):
            lines.append(f"| {r['system']} | {r['workload']} | {r['note']} | | | | | |")
            continue
        lines.append(
            f"| {r['system']} | {r['workload']} | {r['first_sleep_s']:.3f} s ({r['first_x']:.2f}x) | "
            f"{r['later_sleep_s']:.3f} s ({r['later_x']:.2f}x) | {r['wake_s']:.3f} s ({r['wake_x']:.2f}x) | "
            f"{r['released_pct']:.2f} % | {r['host_GiB']:.2f} GiB | {'yes' if r['exact'] else 'NO'} |"
        )
    from torpor.allocator.bench_host import host_markdown

    out = head + "\n".join(lines) + "\n"
    out += host_markdown(data)
    return out
