"""GPU probe: where a cold first sleep's host-memory preparation goes, stage by stage, per chunk size and thread count.

Run on a CUDA machine: ``python benchmarks/probes/probe_cold_pin.py [GiB]``. For each
configuration, on fresh host memory: reserve (mmap, huge pages advised), fault
in with N threads (MADV_POPULATE_WRITE), register each chunk
(cuMemHostRegister) with N threads, and the two fused per chunk (what the
arena's threads do); then the arena's whole pipeline with the copies
(``HostArena.take`` + ``wait_pinned`` + one copy per chunk). Prints seconds and
GB/s per stage, and the copy floor.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from torpor.allocator.host.chunks import HostPolicy
from torpor.allocator.host.offload import Extent, HostArena
from torpor.allocator.native.cuda_driver import (
    CudaDriver,
    free_host_pages,
    populate_host_pages,
    reserve_host_pages,
    transparent_huge_pages,
)

MiB = 1 << 20
GiB = 1 << 30


def _ok(call: str, result: tuple[object, ...]) -> None:
    if int(result[0]) != 0:  # type: ignore[call-overload]
        raise RuntimeError(f"{call}: {result[0]}")


def _register(drv: CudaDriver, host: int, n: int) -> None:
    from cuda.bindings import driver as cu

    drv.prepare_thread()
    _ok("cuMemHostRegister", cu.cuMemHostRegister(host, n, cu.CU_MEMHOSTREGISTER_PORTABLE))


def _unregister(drv: CudaDriver, host: int) -> None:
    from cuda.bindings import driver as cu

    _ok("cuMemHostUnregister", cu.cuMemHostUnregister(host))


def stages(drv: CudaDriver, total: int, chunk: int, threads: int) -> str:
    """Populate, register, and populate+register fused, each on fresh memory."""
    out = []
    chunks = range(0, total, chunk)
    for fused in (False, True):
        base = reserve_host_pages(total)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            if fused:
                list(
                    pool.map(
                        lambda o, b=base: (populate_host_pages(b + o, chunk), _register(drv, b + o, chunk)), chunks
                    )
                )
            else:
                list(pool.map(lambda o, b=base: populate_host_pages(b + o, chunk), chunks))
                t1 = time.perf_counter()
                list(pool.map(lambda o, b=base: _register(drv, b + o, chunk), chunks))
        t2 = time.perf_counter()
        for o in chunks:
            _unregister(drv, base + o)
        free_host_pages(base, total)
        if fused:
            out.append(f"fused {t2 - t0:.3f}s ({total / (t2 - t0) / 1e9:.1f} GB/s)")
        else:
            out.append(f"populate {t1 - t0:.3f}s register {t2 - t1:.3f}s")
    return "; ".join(out)


def copy_pinning(arena: HostArena, drv: CudaDriver, address: int, total: int) -> list[Extent]:
    """Copy ``total`` device bytes at ``address`` into the arena, waiting for each chunk's pin (unstaged)."""
    extents = arena.take(total)
    pos = 0
    for e in extents:
        arena.wait_pinned(e.host)
        drv.copy_d2h(e.host, address + pos, e.nbytes, 0)
        pos += e.nbytes
    drv.wait(drv.record(0))
    return extents


def pipeline(total: int, chunk: int, threads: int) -> str:
    """The arena's cold path with one device-to-host copy per chunk."""
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    drv = CudaDriver()
    arena = HostArena(drv, HostPolicy(chunk_bytes=chunk, threads=threads))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    extents = copy_pinning(arena, drv, dev.data_ptr(), total)
    dt = time.perf_counter() - t0
    arena.give(extents)
    arena.close()
    del dev
    return f"pipeline {dt:.3f}s"


def main() -> None:
    """Every configuration, twice for the first (a fresh process's first pin differs)."""
    total = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
    torch.cuda.init()
    drv = CudaDriver()
    drv.ensure_context(0)
    print(f"THP {transparent_huge_pages()}; {total / GiB:.0f} GiB", flush=True)
    print("first in process:", pipeline(total, 32 * MiB, 16), flush=True)
    for chunk, threads in ((32 * MiB, 16), (128 * MiB, 16), (32 * MiB, 8), (512 * MiB, 16)):
        print(
            f"chunk {chunk // MiB} MiB x {threads} threads:",
            stages(drv, total, chunk, threads),
            "|",
            pipeline(total, chunk, threads),
            flush=True,
        )


if __name__ == "__main__":
    main()
