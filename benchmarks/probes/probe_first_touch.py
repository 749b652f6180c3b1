"""Probe: is a fresh host's first cold sleep slow because its memory is touched for the first time? No GPU needed.

Run first thing on a fresh machine: ``python benchmarks/probes/probe_first_touch.py [GiB]``.
Faults ``GiB`` of host memory in (huge pages advised, 32 MiB chunks, as the
host arena does) with 8 threads, then *another* ``GiB`` with 16 threads while
the first is still held (so both touch memory this host never touched), frees
both, and repeats both on memory touched before. Also reads
``/proc/meminfo`` (free memory, huge pages) and the time the kernel spent.
Prints seconds and GB/s per step.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from torpor.allocator.native.cuda_driver import (
    free_host_pages,
    populate_host_pages,
    reserve_host_pages,
    transparent_huge_pages,
)

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 32 * MiB


def meminfo(keep: tuple[str, ...] = ("MemFree", "AnonHugePages", "Cached")) -> str:
    """The ``keep`` fields of /proc/meminfo, in GiB."""
    out = []
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in keep:
                out.append(f"{key} {int(rest.split()[0]) / (1 << 20):.1f} GiB")
    return ", ".join(out)


def vmstat() -> dict[str, int]:
    """Compaction and huge-page fault counters from /proc/vmstat."""
    keep = ("compact_stall", "compact_fail", "thp_fault_alloc", "thp_fault_fallback")
    out = {}
    with open("/proc/vmstat") as f:
        for line in f:
            key, _, value = line.partition(" ")
            if key in keep:
                out[key] = int(value)
    return out


def touch(total: int, threads: int) -> tuple[int, float, float]:
    """Reserve and fault in ``total`` bytes with ``threads`` threads; (address, seconds, kernel seconds)."""
    base = reserve_host_pages(total)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda o: populate_host_pages(base + o, CHUNK), range(0, total, CHUNK)))
    dt = time.perf_counter() - t0
    return base, dt, resource.getrusage(resource.RUSAGE_SELF).ru_stime - before


def main() -> None:
    """Fresh memory with 8 and 16 threads, then the same on memory touched before."""
    total = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
    try:
        with open("/sys/kernel/mm/transparent_hugepage/defrag") as f:
            defrag = f.read().strip()
    except OSError:
        defrag = "unavailable"
    print(
        f"THP {transparent_huge_pages()} (defrag {defrag}); {os.cpu_count()} CPUs; {total / GiB:g} GiB; {meminfo()}",
        flush=True,
    )
    held = []
    for label, threads in (("fresh", 8), ("fresh", 16), ("touched", 8), ("touched", 16)):
        if label == "touched" and held:
            for base in held:
                free_host_pages(base, total)
            held.clear()
        counters = vmstat()
        base, dt, sys_s = touch(total, threads)
        delta = {k: v - counters.get(k, 0) for k, v in vmstat().items()}
        held.append(base) if label == "fresh" else free_host_pages(base, total)
        print(
            f"{label} memory, {threads} threads: {dt:.3f}s ({total / dt / 1e9:.1f} GB/s), kernel {sys_s:.2f} CPU-s; {meminfo()}; {delta}",
            flush=True,
        )


if __name__ == "__main__":
    main()
