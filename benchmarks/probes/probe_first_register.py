"""GPU probe: is the first process's slow ``cuMemHostRegister`` a cost per page never registered before?

Run on a CUDA machine, first in a freshly started machine, then again:
``python benchmarks/probes/probe_first_register.py [GiB]``. Prints, one line each:

- registering fresh pages (faulted in first) from one thread, then the same pages
  again after unregistering them, then other fresh pages;
- ``threads`` threads registering fresh pages at once;
- a staged copy's CPU side: ``threads`` threads copying from registered memory into
  fresh pageable memory (huge pages advised), the work a sleep through a small
  pinned ring would do instead of registering its destination.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

from torpor.allocator.native import cuda_driver
from torpor.allocator.native.cuda_driver import free_host_pages, populate_host_pages, reserve_host_pages

GiB = 1 << 30
MiB = 1 << 20
PIECE = 32 * MiB


def _cu() -> object:
    return cuda_driver._cu()


def _check(what: str, result: object) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what}: {err}")


def register(address: int, nbytes: int) -> float:
    cu = _cu()
    start = time.perf_counter()
    for off in range(0, nbytes, PIECE):
        _check(
            "register", cu.cuMemHostRegister(address + off, min(PIECE, nbytes - off), cu.CU_MEMHOSTREGISTER_PORTABLE)
        )  # type: ignore[attr-defined]
    return time.perf_counter() - start


def unregister(address: int, nbytes: int) -> float:
    cu = _cu()
    start = time.perf_counter()
    for off in range(0, nbytes, PIECE):
        _check("unregister", cu.cuMemHostUnregister(address + off))  # type: ignore[attr-defined]
    return time.perf_counter() - start


def fresh(nbytes: int) -> tuple[int, float]:
    address = reserve_host_pages(nbytes)
    start = time.perf_counter()
    populate_host_pages(address, nbytes)
    return address, time.perf_counter() - start


def in_threads(n: int, fn: object, *args: object) -> float:
    threads = [threading.Thread(target=fn, args=(i, *args)) for i in range(n)]  # type: ignore[arg-type]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    nbytes = int(gib * GiB)
    threads = min(8, os.cpu_count() or 4)
    driver = cuda_driver.CudaDriver()
    driver.ensure_context(0)
    a, fault_a = fresh(nbytes)
    reg_a = register(a, nbytes)
    unreg_a = unregister(a, nbytes)
    reg_a2 = register(a, nbytes)
    print(
        f"one thread, {gib:g} GiB fresh: fault {fault_a:.3f} s, register {reg_a:.3f} s, unregister {unreg_a:.3f} s, same pages again {reg_a2:.3f} s"
    )
    b, fault_b = fresh(nbytes)
    reg_b = register(b, nbytes)
    print(f"one thread, {gib:g} GiB other fresh pages: fault {fault_b:.3f} s, register {reg_b:.3f} s")
    unregister(b, nbytes)
    free_host_pages(b, nbytes)

    per = nbytes // threads
    spans = [fresh(per)[0] for _ in range(threads)]

    def reg_one(i: int) -> None:
        driver.ensure_context(0)
        register(spans[i], per)

    print(f"{threads} threads registering {gib:g} GiB of fresh pages at once: {in_threads(threads, reg_one):.3f} s")
    for s in spans:
        unregister(s, per)
        free_host_pages(s, per)

    # the staged path's CPU side: a registered source (a) copied into fresh pageable memory by several threads
    for n in (threads, 2 * threads):
        dst = reserve_host_pages(nbytes)
        step = nbytes // n

        def copy_one(i: int, dst: int = dst, step: int = step) -> None:
            for off in range(i * step, (i + 1) * step, PIECE):
                ctypes.memmove(dst + off, a + off, min(PIECE, (i + 1) * step - off))

        took = in_threads(n, copy_one)
        print(
            f"{n} threads copying {gib:g} GiB into fresh pageable memory: {took:.3f} s ({nbytes / took / 1e9:.1f} GB/s)"
        )
        free_host_pages(dst, nbytes)
    unregister(a, nbytes)
    free_host_pages(a, nbytes)


if __name__ == "__main__":
    main()
