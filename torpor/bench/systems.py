"""The systems the benchmark compares on one workload: torpor (raw allocations and a real graph pool), a vLLM-style baseline, torch_memory_saver.

The baseline copies each allocation synchronously into pinned memory taken
from torch's pinned-memory cache, as vLLM's CuMemAllocator does (written here
from that description).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from torpor import tms as torpor_tms  # a lazy package: its saver is made on first use
from torpor.allocator import TaggedAllocator
from torpor.bench.device import fill, free_device, same
from torpor.bench.result import Result
from torpor.errors import BenchError
from torpor.statemachine.core.policy import HostMemoryPolicy, Policy
from torpor.statemachine.machine.controller import SleepController
from torpor.units import MiB

# -- torpor -------------------------------------------------------------------------------


def timed_sleep_wake(ctl: SleepController, alloc: TaggedAllocator, res: Result) -> None:
    """One ``sleep(1)`` and ``wake()``, timed into ``res``: durations, device bytes released, host bytes held asleep."""
    before = free_device()
    t = time.perf_counter()
    ctl.sleep(1)
    res.sleeps.append(time.perf_counter() - t)
    res.released.append(free_device() - before)
    res.host_held = alloc.pinned_bytes()
    t = time.perf_counter()
    ctl.wake()
    res.wakes.append(time.perf_counter() - t)


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
    own = alloc is None
    alloc = alloc or TaggedAllocator()
    host = host or HostMemoryPolicy()
    ctl = SleepController(alloc, policy=Policy(host=host))
    t0 = time.perf_counter()
    ranges = [(alloc.allocate(seg_bytes, "weights"), seg_bytes) for _ in range(segments)]
    refs = fill(ranges)
    ready = alloc.wait_host_ready(600)
    res = Result("torpor", name, segments * seg_bytes, segments, prepare_s=time.perf_counter() - t0)
    res.host_mode = f"{host.pin.value}, {host.after_wake.value}"
    res.pinned_awake = alloc.pinned_bytes()
    if not ready:
        res.note = "pin-ahead did not finish"
    for _ in range(cycles):
        timed_sleep_wake(ctl, alloc, res)
        res.pinned_asleep = res.host_held
        alloc.wait_host_unpinned(60)
        res.pinned_after_wake = alloc.pinned_bytes()
        res.exact = res.exact and same(ranges, refs)
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
            raise BenchError(msg)
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
    refs = fill(ranges)
    res = Result("vllm-style", name, segments * seg_bytes, segments)
    for _ in range(cycles):
        before = free_device()
        t = time.perf_counter()
        base.sleep()
        res.sleeps.append(time.perf_counter() - t)
        res.released.append(free_device() - before)
        res.host_held = sum(a[1] for a in base.allocs)
        t = time.perf_counter()
        base.wake()
        torch.cuda.synchronize()
        res.wakes.append(time.perf_counter() - t)
        res.exact = res.exact and same(ranges, refs)
    del refs
    base.close()
    if not keep_host_cache:
        torch._C._host_emptyCache()
    return res


#: The torch_memory_saver APIs whose write-once ``hook_mode`` this process has set.
_TORCH_MODE: set[str] = set()


def torch_mode_saver(system: str = "torch_memory_saver") -> Any:
    """The process's saver of ``system`` (``"torch_memory_saver"``, the package, or ``"torpor.tms"``) in hook mode torch.

    Its pluggable-allocator mode (no LD_PRELOAD), set on the first call: the mode is settable once per
    process. Raises what importing the package raises (it is not on the GPU image by default).
    """
    saver: Any
    if system == "torpor.tms":
        saver = torpor_tms.torch_memory_saver
    else:
        import torch_memory_saver

        saver = torch_memory_saver.torch_memory_saver
    if system not in _TORCH_MODE:
        saver.hook_mode = "torch"
        _TORCH_MODE.add(system)
    return saver


def run_tms_raw(name: str, segments: int, seg_bytes: int, cycles: int) -> Result:
    """torch_memory_saver with CPU backup, when importable (its wheel is not on the GPU image)."""
    import torch

    res = Result("torch_memory_saver", name, segments * seg_bytes, segments)
    try:
        tms = torch_mode_saver()
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
        before = free_device()
        t0 = time.perf_counter()
        tms.pause("bench")
        torch.cuda.synchronize()
        res.sleeps.append(time.perf_counter() - t0)
        res.released.append(free_device() - before)
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
        timed_sleep_wake(ctl, alloc, res)
        for (g, out, _), ref in zip(graphs, refs, strict=True):
            out.zero_()  # a replay must write it again
            g.replay()
            torch.cuda.synchronize()
            res.exact = res.exact and bool(torch.equal(out, ref))
    del graphs, refs, model, layer, inputs
    gc.collect()
    return res
