"""GPU probe: which torch allocator calls, made from several threads at once, crash torch (no torpor code runs).

``python benchmarks/probes/probe_torch_race.py MODE [seconds]``, each mode in its own
process; a crash shows as a signal exit code and faulthandler's thread stacks.
Every mode runs four allocating threads and a fifth calling
``torch.cuda.memory_stats()`` and ``empty_cache()`` in a loop, like
tests/test_allocator_threads_gpu.py; the threads differ:

- ``alloc``: each thread allocates and frees in a ``MemPool`` of its own (torch's allocator);
- ``refuse``: each thread allocates in a ``MemPool`` whose pluggable allocator refuses
  every malloc (torch's out-of-memory path), as a tag that is asleep does;
- ``snapshot``: ``alloc`` plus a sixth thread reading idle pools' snapshots;
- ``newpools``: ``alloc`` with a new ``MemPool`` for every block (kept, never destroyed);
- ``refuse+snapshot``: two threads of ``alloc``, two of ``refuse``, and the snapshot thread;
- ``toggle``: ``alloc`` on a pluggable allocator that refuses 0.3 s of every 0.8 s (a tag
  going to sleep and waking), plus the snapshot thread.

A ``p`` before a mode (``palloc``, ``psnapshot``, ...) makes the allocating threads' pools
use a pluggable allocator on ``cuMemAlloc`` (as torpor's tags do) instead of torch's own.
"""

from __future__ import annotations

import faulthandler
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

C_SOURCE = """
#include <dlfcn.h>
#include <stddef.h>
#include <sys/types.h>
typedef int (*alloc_fn)(unsigned long long *, size_t);
typedef int (*free_fn)(unsigned long long);
static alloc_fn cu_alloc;
static free_fn cu_free;
static int refusing;
void probe_refuse(int on) { __atomic_store_n(&refusing, on, __ATOMIC_SEQ_CST); }
void *probe_refuse_malloc(ssize_t size, int device, void *stream) { (void)size; (void)device; (void)stream; return NULL; }
void probe_refuse_free(void *ptr, ssize_t size, int device, void *stream) { (void)ptr; (void)size; (void)device; (void)stream; }
void *probe_malloc(ssize_t size, int device, void *stream) {
  (void)device; (void)stream;
  if (__atomic_load_n(&refusing, __ATOMIC_SEQ_CST)) return NULL;
  if (!cu_alloc) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW);
    cu_free = (free_fn)dlsym(h, "cuMemFree_v2");
    cu_alloc = (alloc_fn)dlsym(h, "cuMemAlloc_v2");
  }
  unsigned long long p = 0;
  return cu_alloc(&p, (size_t)size) ? NULL : (void *)p;
}
void probe_free(void *ptr, ssize_t size, int device, void *stream) { (void)size; (void)device; (void)stream; if (ptr) cu_free((unsigned long long)ptr); }
"""


LIB: list[str] = []


def library() -> str:
    """The probe's pluggable allocators, built with cc into a temporary folder (once)."""
    if LIB:
        return LIB[0]
    folder = tempfile.mkdtemp(prefix="probe-race-")
    src, lib = os.path.join(folder, "refuse.c"), os.path.join(folder, "librefuse.so")
    with open(src, "w") as f:
        f.write(C_SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", lib, src, "-ldl"], check=True)
    LIB.append(lib)
    return lib


def refusing_allocator() -> Any:
    """A pluggable allocator whose malloc returns NULL."""
    return torch.cuda.memory.CUDAPluggableAllocator(library(), "probe_refuse_malloc", "probe_refuse_free").allocator()


def plain_allocator() -> Any:
    """A pluggable allocator on cuMemAlloc that refuses while ``toggle`` mode says so."""
    return torch.cuda.memory.CUDAPluggableAllocator(library(), "probe_malloc", "probe_free").allocator()


COUNTS: dict[str, int] = {}
LOCK = threading.Lock()


def bump(name: str) -> None:
    with LOCK:
        COUNTS[name] = COUNTS.get(name, 0) + 1


def allocating(i: int, stop: threading.Event, pools: list[Any], fresh: bool, allocator: Any = None) -> None:
    rng = random.Random(i)
    pool = torch.cuda.MemPool(allocator)
    pools.append(pool)
    while not stop.is_set():
        if fresh:
            pool = torch.cuda.MemPool(allocator)
            pools.append(pool)
        try:
            with torch.cuda.use_mem_pool(pool):
                held = [
                    torch.empty(rng.choice([512, 65536, 1 << 20, 3 << 20, 9 << 20]), dtype=torch.uint8, device="cuda")
                    for _ in range(8)
                ]
            del held[::2]
            del held
            bump("alloc")
        except torch.OutOfMemoryError:
            bump("refused")


def refused(i: int, stop: threading.Event, allocator: Any, pools: list[Any]) -> None:
    pool = torch.cuda.MemPool(allocator)
    pools.append(pool)  # kept: a pool destroyed while another thread is in use_mem_pool aborts torch 2.11
    while not stop.is_set():
        try:
            with torch.cuda.use_mem_pool(pool):
                torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            bump("refused")


def stats(stop: threading.Event) -> None:
    while not stop.is_set():
        torch.cuda.memory_stats()
        torch.cuda.empty_cache()
        bump("stats")
        time.sleep(0.002)


def snapshots(stop: threading.Event, pools: list[Any]) -> None:
    rng = random.Random(99)
    while not stop.is_set():
        if pools:
            rng.choice(pools).snapshot(include_traces=False)
            bump("snapshot")


def toggling(stop: threading.Event) -> None:
    import ctypes

    lib = ctypes.CDLL(library())
    while not stop.is_set():
        lib.probe_refuse(1)
        time.sleep(0.3)
        lib.probe_refuse(0)
        time.sleep(0.5)
        bump("toggle")


def main() -> None:
    mode = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    faulthandler.enable(all_threads=True)
    torch.zeros(1, device="cuda")
    stop = threading.Event()
    pools: list[Any] = []
    targets: list[tuple[Any, tuple[Any, ...]]] = [(stats, (stop,))]
    base = mode.removeprefix("p")
    allocator = plain_allocator() if mode.startswith("p") else None
    if base in ("alloc", "snapshot", "newpools", "toggle"):
        targets += [(allocating, (i, stop, pools, base == "newpools", allocator)) for i in range(4)]
    if base == "refuse":
        targets += [(refused, (i, stop, refusing_allocator(), pools)) for i in range(4)]
    if base == "refuse+snapshot":
        targets += [(allocating, (i, stop, pools, False, allocator)) for i in range(2)]
        targets += [(refused, (i, stop, refusing_allocator(), pools)) for i in range(2)]
    if base == "toggle":
        targets += [(toggling, (stop,)), (snapshots, (stop, pools))]
    if "snapshot" in base:
        targets.append((snapshots, (stop, pools)))
    threads = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in targets]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    print(f"{mode}: survived {seconds:g} s, counts {dict(sorted(COUNTS.items()))}, pools {len(pools)}")


if __name__ == "__main__":
    main()
