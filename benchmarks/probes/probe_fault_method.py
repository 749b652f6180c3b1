"""Probe: faulting fresh host memory in by ``MADV_POPULATE_WRITE`` against by writing it (``memset``), interleaved.

Run first in a freshly started machine: ``python benchmarks/probes/probe_fault_method.py [GiB per region] [rounds]``.
Each round faults one new region with ``MADV_POPULATE_WRITE`` and one with ``memset`` (16 threads each,
huge pages advised, the regions kept until the end so every region is memory the process never used), and
prints the rate of each. It tells whether the staged sleep's ring and the pinned pipeline's chunks should be
faulted in by writing rather than by populating (docs/benchmarks.md, issue 14).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

from probe_first_register import in_threads  # benchmarks/ is the script's folder

from torpor.allocator.native.cuda_driver import populate_host_pages, reserve_host_pages

GiB = 1 << 30
THREADS = 16


def fault(base: int, nbytes: int, fn: Callable[[int, int], object]) -> float:
    """Seconds ``THREADS`` threads take to run ``fn`` on their share of the range."""
    step = nbytes // THREADS
    return in_threads(THREADS, lambda i: fn(base + i * step, step))


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    nbytes = int(gib * GiB)
    for r in range(rounds):
        for name, fn in (("populate", populate_host_pages), ("memset", lambda a, n: ctypes.memset(a, 0, n))):
            took = fault(reserve_host_pages(nbytes), nbytes, fn)
            print(f"round {r} {name:8s} {gib:g} GiB, {THREADS} threads: {took:.3f} s ({nbytes / took / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
