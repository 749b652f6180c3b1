"""GPU probe: a cold first sleep through a small pinned ring (a staged copy), against pinning the destination.

Run on a CUDA machine, first in a freshly started machine:
``python benchmarks/probes/probe_staged_copy.py [GiB] [order]`` with ``order`` a comma list of

- ``staged``: device -> a ring of small registered slots -> ``threads`` threads copy each slot into fresh
  pageable memory (huge pages advised); then that memory is registered (what a wake needs), timed apart;
  then copied back and compared;
- ``fault``: ``threads`` threads fault fresh memory in, then 8 threads register it (phased, no copy);
- ``pinned``: torpor's path today: the host arena reserves chunks that threads fault in and register while the
  main thread copies into each chunk once it is registered.

Every variant keeps its memory until the process ends, so each one faults pages no earlier variant touched.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time

import torch
from probe_cold_pin import copy_pinning  # benchmarks/ is the script's folder
from probe_first_register import in_threads

from torpor.allocator.host.chunks import HostPolicy
from torpor.allocator.host.offload import HostArena
from torpor.allocator.native import cuda_driver
from torpor.allocator.native.cuda_driver import populate_host_pages, reserve_host_pages
from torpor.bench.device import measure_floor

GiB = 1 << 30
MiB = 1 << 20
PIECE = 16 * MiB
THREADS = 16
SLOTS = 32


def register_all(driver: cuda_driver.CudaDriver, address: int, nbytes: int, threads: int = 8) -> float:
    step = 32 * MiB
    offsets = list(range(0, nbytes, step))

    def one(i: int) -> None:
        driver.prepare_thread()
        for off in offsets[i::threads]:
            driver.host_alloc(min(step, nbytes - off), address + off)

    return in_threads(threads, one)


def staged(driver: cuda_driver.CudaDriver, src: torch.Tensor, floor: float) -> None:
    nbytes = src.numel()
    ring = driver.host_alloc(SLOTS * PIECE)
    free: queue.Queue[int] = queue.Queue()
    for i in range(SLOTS):
        free.put(ring + i * PIECE)
    work: queue.Queue[tuple[object, int, int, int] | None] = queue.Queue()
    dst = reserve_host_pages(nbytes)

    def worker(_: int) -> None:
        driver.prepare_thread()
        while (item := work.get()) is not None:
            event, slot, off, n = item
            driver.wait(event)
            ctypes.memmove(dst + off, slot, n)
            free.put(slot)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    base = src.data_ptr()
    for off in range(0, nbytes, PIECE):
        n = min(PIECE, nbytes - off)
        slot = free.get()
        driver.copy_d2h(slot, base + off, n, 0)
        work.put((driver.record(0), slot, off, n))
    for _ in threads:
        work.put(None)
    for t in threads:
        t.join()
    took = time.perf_counter() - start
    print(f"staged copy done: {took:.3f} s ({took / floor:.2f}x the floor)", flush=True)
    reg = register_all(driver, dst, nbytes)
    back = torch.empty_like(src)
    t = time.perf_counter()
    for off in range(0, nbytes, 32 * MiB):  # one copy per registration: a copy may not span two
        driver.copy_h2d(back.data_ptr() + off, dst + off, min(32 * MiB, nbytes - off), 0)
    driver.synchronize(0)
    h2d = time.perf_counter() - t
    same = bool(torch.equal(back, src))
    print(
        f"staged {nbytes / GiB:g} GiB ({THREADS} threads, {SLOTS} x {PIECE // MiB} MiB ring): copy {took:.3f} s "
        f"({took / floor:.2f}x the floor), then register {reg:.3f} s, H2D {h2d:.3f} s, bit-exact {same}",
        flush=True,
    )
    del back


def fault(driver: cuda_driver.CudaDriver, nbytes: int) -> None:
    dst = reserve_host_pages(nbytes)
    step = nbytes // THREADS

    def one(i: int) -> None:
        populate_host_pages(dst + i * step, step)

    took = in_threads(THREADS, one)
    reg = register_all(driver, dst, nbytes)
    print(f"fault {nbytes / GiB:g} GiB ({THREADS} threads): {took:.3f} s, then register (8 threads) {reg:.3f} s")


def pinned(driver: cuda_driver.CudaDriver, src: torch.Tensor, floor: float) -> None:
    nbytes = src.numel()
    arena = HostArena(driver, HostPolicy())
    start = time.perf_counter()
    copy_pinning(arena, driver, src.data_ptr(), nbytes)
    took = time.perf_counter() - start
    print(f"pinned {nbytes / GiB:g} GiB (the arena today): {took:.3f} s ({took / floor:.2f}x the floor)", flush=True)


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    order = (sys.argv[2] if len(sys.argv) > 2 else "staged,fault,pinned").split(",")
    nbytes = int(gib * GiB)
    torch.cuda.init()
    d2h, _ = measure_floor()
    floor = nbytes / d2h
    print(f"floor {floor:.3f} s ({d2h / 1e9:.1f} GB/s)", flush=True)
    driver = cuda_driver.CudaDriver()
    driver.ensure_context(0)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    for name in order:
        if name == "staged":
            staged(driver, src, floor)
        elif name == "fault":
            fault(driver, nbytes)
        elif name == "pinned":
            pinned(driver, src, floor)


if __name__ == "__main__":
    main()
