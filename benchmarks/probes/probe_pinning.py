"""GPU probe: how much does pinning host memory in a background thread stall an awake engine, per chunk size, thread count and method?

Run on a CUDA machine: ``python benchmarks/probes/probe_pinning.py [GiB]``. The
"engine" is a loop of ``torpor.bench.engine_step`` (a 16 MiB
pinned input copy, a bf16 matmul, 32 small kernels, synchronize). For each configuration a background pool pins
GiB of host memory while the loop runs; printed: pinning time, step median,
p99 and max, and the stall (time the steps took beyond the idle median).
Methods: ``alloc`` (cuMemHostAlloc) and ``register`` (mmap'd memory, touched
page by page, then cuMemHostRegister).
"""

from __future__ import annotations

import ctypes
import mmap
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from cuda.bindings import driver as cu

from torpor.bench import engine_step

MiB = 1 << 20
GiB = 1 << 30


def ck(r):  # type: ignore[no-untyped-def]
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{r[0]}")
    return r[1] if len(r) == 2 else None


def main() -> None:
    total = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 4 * GiB
    torch.zeros(1, device="cuda")
    ctx = ck(cu.cuCtxGetCurrent())
    step = engine_step()
    idle = [step() for _ in range(300)]
    base = statistics.median(idle)
    print(f"idle step: median {base * 1e3:.3f} ms, max {max(idle) * 1e3:.3f} ms")

    def pin_alloc(chunk: int) -> tuple[int, object]:
        ck(cu.cuCtxSetCurrent(ctx))
        return ck(cu.cuMemHostAlloc(chunk, cu.CU_MEMHOSTALLOC_PORTABLE)), None

    def pin_register(chunk: int) -> tuple[int, object]:
        ck(cu.cuCtxSetCurrent(ctx))
        m = mmap.mmap(-1, chunk, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        ck(cu.cuMemHostRegister(addr, chunk, cu.CU_MEMHOSTREGISTER_PORTABLE))
        return addr, m

    configs = [
        ("alloc", 256 * MiB, 16),
        ("alloc", 64 * MiB, 4),
        ("alloc", 32 * MiB, 1),
        ("alloc", 8 * MiB, 1),
        ("register", 256 * MiB, 4),
        ("register", 32 * MiB, 1),
    ]
    for method, chunk, threads in configs:
        fn = pin_alloc if method == "alloc" else pin_register
        done = threading.Event()
        got: list[tuple[int, object]] = []
        t0 = time.perf_counter()
        took = [0.0]

        def pinner(fn=fn, chunk=chunk, threads=threads, got=got, done=done, took=took, t0=t0) -> None:  # type: ignore[no-untyped-def]
            with ThreadPoolExecutor(threads) as pool:
                got.extend(pool.map(lambda _: fn(chunk), range(total // chunk)))
            took[0] = time.perf_counter() - t0
            done.set()

        th = threading.Thread(target=pinner, daemon=True)
        th.start()
        busy = []
        while not done.is_set() or len(busy) < 20:
            busy.append(step())
        th.join()
        busy.sort()
        stall = sum(busy) - len(busy) * base
        print(
            f"{method:8s} chunk {chunk // MiB:4d} MiB x {threads:2d} threads: pinned {total / GiB:.0f} GiB in {took[0]:.2f} s; "
            f"steps {len(busy)}: median {statistics.median(busy) * 1e3:.3f} ms, "
            f"p99 {busy[int(0.99 * (len(busy) - 1))] * 1e3:.1f} ms, max {busy[-1] * 1e3:.1f} ms, "
            f"stall {stall:.2f} s ({stall / max(took[0], 1e-9) * 100:.0f} % of the pinning time)"
        )
        for addr, m in got:
            if m is None:
                ck(cu.cuMemFreeHost(addr))
            else:
                ck(cu.cuMemHostUnregister(addr))
                del m
        got.clear()


if __name__ == "__main__":
    main()
