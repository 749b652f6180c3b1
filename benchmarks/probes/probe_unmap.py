"""GPU probe for the first sleep over many small mappings: does cuMemUnmap take a span of several mappings, and what does each unmap strategy cost?

Run on a CUDA machine: ``python benchmarks/probes/probe_unmap.py``. Uses torpor's
VmmDriver (the allocator's own driver calls). Prints one line per finding.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from torpor.errors import DriverError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its VMM helper
from vmm import VmmDriver

MiB = 1 << 20
SEG = 2 * MiB
COUNT = 2048
BATCH = 32  # 64 MiB per batch, the allocator's default group size


def _map_all(drv: VmmDriver, base: int, count: int, release_now: bool) -> list[object]:
    handles: list[object] = []
    for i in range(count):
        h = drv.create(SEG, 0)
        drv.map(base + i * SEG, SEG, h)
        drv.set_access(base + i * SEG, SEG, 0)
        if release_now:
            drv.release(h)
        else:
            handles.append(h)
    return handles


def semantics(drv: VmmDriver, base: int) -> None:
    """What cuMemUnmap accepts: a span of whole mappings, a span with a hole, half a mapping."""
    free0 = drv.mem_info(0)[0]
    _map_all(drv, base, 8, release_now=True)
    try:
        drv.unmap(base, 8 * SEG)
        freed = drv.mem_info(0)[0] - free0 + 8 * SEG
        print(
            f"span unmap of 8 whole mappings (handles released at map): OK; device bytes back {freed >> 20} MiB of 16"
        )
    except DriverError as exc:
        print(f"span unmap of 8 whole mappings: REFUSED {exc}")
        for i in range(8):
            drv.unmap(base + i * SEG, SEG)
    handles = _map_all(drv, base, 8, release_now=False)
    try:
        drv.unmap(base, 8 * SEG)
        print("span unmap of 8 whole mappings (handles kept): OK")
    except DriverError as exc:
        print(f"span unmap with handles kept: REFUSED {exc}")
        for i in range(8):
            drv.unmap(base + i * SEG, SEG)
    for h in handles:
        drv.release(h)
    _map_all(drv, base, 3, release_now=True)
    drv.unmap(base + SEG, SEG)  # make a hole in the middle
    try:
        drv.unmap(base, 3 * SEG)
        print("span unmap over a hole: OK")
    except DriverError as exc:
        print(f"span unmap over a hole: REFUSED {exc}")
        drv.unmap(base, SEG)
        drv.unmap(base + 2 * SEG, SEG)
    h = drv.create(2 * SEG, 0)
    drv.map(base, 2 * SEG, h)
    drv.release(h)
    try:
        drv.unmap(base, SEG)
        print("unmap of half a mapping: OK (unexpected)")
        drv.unmap(base + SEG, SEG)
    except DriverError as exc:
        print(f"unmap of half a mapping: REFUSED {exc}")
        drv.unmap(base, 2 * SEG)
    print(f"free after semantics checks: {(drv.mem_info(0)[0] - free0) >> 20} MiB difference (0 expected)")


def first_sleep(drv: VmmDriver, base: int, host: int, mode: str) -> float:
    """Copy 2048 x 2 MiB to pinned host per batch and unmap each batch after its copy; return seconds."""
    handles = _map_all(drv, base, COUNT, release_now=mode != "keep")
    drv.synchronize(0)
    t0 = time.perf_counter()
    pending = []
    for b in range(0, COUNT, BATCH):
        for i in range(b, b + BATCH):
            drv.copy_d2h(host + i * SEG, base + i * SEG, SEG, 0)
        pending.append((b, drv.record(0)))
    for b, ev in pending:
        drv.wait(ev)
        if mode == "span":
            drv.unmap(base + b * SEG, BATCH * SEG)
        else:
            for i in range(b, b + BATCH):
                drv.unmap(base + i * SEG, SEG)
                if mode == "keep":
                    drv.release(handles[i])
    dt = time.perf_counter() - t0
    return dt


def main() -> None:
    import torch

    torch.zeros(1, device="cuda")
    drv = VmmDriver()
    drv.ensure_context(0)
    total = COUNT * SEG
    base = drv.reserve(total, 0)
    host = drv.host_alloc(total)
    semantics(drv, base)
    # the floor: one copy of the whole range, mapped as one
    h = drv.create(total, 0)
    drv.map(base, total, h)
    drv.set_access(base, total, 0)
    best = float("inf")
    for _ in range(5):
        drv.synchronize(0)
        t0 = time.perf_counter()
        drv.copy_d2h(host, base, total, 0)
        drv.synchronize(0)
        best = min(best, time.perf_counter() - t0)
    drv.unmap(base, total)
    drv.release(h)
    print(f"floor: 4 GiB device-to-host in {best * 1e3:.1f} ms ({total / best / 1e9:.1f} GB/s)")
    for mode in ("keep", "released", "span", "keep", "released", "span", "keep", "released", "span"):
        try:
            dt = first_sleep(drv, base, host, mode)
            print(f"first sleep, {mode:8s}: {dt * 1e3:.1f} ms = {dt / best:.2f}x the floor")
        except DriverError as exc:
            print(f"first sleep, {mode}: FAILED {exc}")
            return
    t0 = time.perf_counter()
    hs = [drv.create(SEG, 0) for _ in range(COUNT)]
    t1 = time.perf_counter()
    for i, hh in enumerate(hs):
        drv.map(base + i * SEG, SEG, hh)
    t2 = time.perf_counter()
    drv.set_access(base, total, 0)
    t3 = time.perf_counter()
    for hh in hs:
        drv.release(hh)
    t4 = time.perf_counter()
    drv.unmap(base, total)
    t5 = time.perf_counter()
    n = COUNT
    print(
        f"per 2 MiB segment: create {(t1 - t0) / n * 1e6:.1f} us, map {(t2 - t1) / n * 1e6:.1f} us, "
        f"set_access (one call) {(t3 - t2) * 1e3:.2f} ms total, release while mapped {(t4 - t3) / n * 1e6:.1f} us, "
        f"one span unmap of all {(t5 - t4) * 1e3:.2f} ms"
    )
    drv.host_free(host)
    drv.unreserve(base, total)


if __name__ == "__main__":
    main()
