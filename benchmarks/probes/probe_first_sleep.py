"""GPU probe: where the first cold sleep of a fresh process spends its time, against a later one.

Run on a CUDA machine, each mode in a fresh process:
``python benchmarks/probes/probe_first_sleep.py MODE [GiB] [segments]`` with MODE one of

- ``plain``: the bench's first row (tensors made, then ``sleep(1)`` with nothing pinned);
- ``prime``: the same after pinning and unpinning one 2 MiB page from 8 threads first
  (a process's one-time registration setup done ahead, timed apart).

With staging (the default), the timeline has the staging threads' waits and host copies,
the main thread's ring copies (``stage_copy``, which block while every slot is in use),
``stage_finish``, and the background registrations (``host_register``) after the release.

Prints the sleep's wall time against the copy floor, then a timeline: per pinning
thread its first call (context, capture mode), each chunk's pin (``host_alloc``: page
faulting and registration, one call into the native library), and the main thread's waits for pinned chunks and its copies; then
cProfile's top entries for the main thread.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import torch

from torpor import HostMemoryPolicy, Policy, SleepController, TaggedAllocator
from torpor.allocator.host.offload import HostArena
from torpor.allocator.host.staging import Stager
from torpor.allocator.native import cuda_driver
from torpor.allocator.sleepwake.cycle import SleepWake
from torpor.bench.device import fill, measure_floor

GiB = 1 << 30
MiB = 1 << 20
T0 = time.perf_counter()
LOG: list[tuple[str, str, float, float]] = []
_LOCK = threading.Lock()


def _timed(name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with _LOCK:
                LOG.append((threading.current_thread().name, name, start - T0, time.perf_counter() - start))

    return wrapper


def instrument() -> None:
    """Wrap the pins, registrations, thread setup, the waits, the copies and the staging steps."""
    drv = cuda_driver.CudaDriver  # a pin (fault in + register) is one library call now: host_alloc
    wrapped: list[tuple[object, str, str]] = [
        *((drv, n, n) for n in ("prepare_thread", "host_alloc", "copy_d2h", "host_copy", "host_register", "wait")),
        *((HostArena, n, n) for n in ("wait_pinned", "wait_readable", "take", "end_staging")),
        (Stager, "copy", "stage_copy"),
        (Stager, "finish", "stage_finish"),
        *((SleepWake, n, n) for n in ("backup", "release", "restore")),
    ]
    for owner, attr, name in wrapped:
        setattr(owner, attr, _timed(name, getattr(owner, attr)))


def summary(since: float) -> str:
    """Per thread and call: count, total seconds, first start, the longest call."""
    rows: dict[tuple[str, str], list[float]] = defaultdict(list)
    first: dict[tuple[str, str], float] = {}
    with _LOCK:
        for thread, name, start, dt in LOG:
            if start < since:
                continue
            rows[thread, name].append(dt)
            first.setdefault((thread, name), start - since)
    out = []
    for (thread, name), dts in sorted(rows.items(), key=lambda kv: first[kv[0]]):
        out.append(
            f"  {thread:24s} {name:15s} n={len(dts):4d} total={sum(dts):.3f}s max={max(dts):.3f}s "
            f"first_at=+{first[thread, name]:.3f}s"
        )
    return "\n".join(out)


def prime(driver: Any, threads: int = 8) -> None:
    """Pin and unpin one fresh 2 MiB page in each of ``threads`` threads."""

    def one() -> None:
        driver.prepare_thread()
        driver.host_free(driver.host_alloc(2 * MiB))

    workers = [threading.Thread(target=one, name=f"prime-{i}") for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def main() -> None:
    """One cold sleep (and a later one) in this process, instrumented."""
    mode = sys.argv[1] if len(sys.argv) > 1 else "plain"
    total = int(float(sys.argv[2]) * GiB) if len(sys.argv) > 2 else 8 * GiB
    segments = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    torch.cuda.init()
    d2h, _ = measure_floor()
    floor = total / d2h
    instrument()
    alloc = TaggedAllocator()
    ctl = SleepController(alloc, policy=Policy(host=HostMemoryPolicy()))
    if mode == "prime":
        t = time.perf_counter()
        prime(alloc.driver)
        print(f"prime: {time.perf_counter() - t:.3f}s", flush=True)
        print(summary(t - T0), flush=True)
    seg = total // segments
    ranges = [(alloc.allocate(seg, "weights"), seg) for _ in range(segments)]
    refs = fill(ranges)
    torch.cuda.synchronize()
    for cycle in range(2):
        since = time.perf_counter() - T0
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        ctl.sleep(1)
        prof.disable()
        dt = time.perf_counter() - t
        print(f"[{mode}] sleep {cycle}: {dt:.3f}s = {dt / floor:.2f}x the floor ({floor:.3f}s)", flush=True)
        print(summary(since), flush=True)
        if cycle == 0:
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(22)
            print(text.getvalue()[-6000:], flush=True)
        t = time.perf_counter()
        ctl.wake()
        print(f"[{mode}] wake {cycle}: {time.perf_counter() - t:.3f}s (the whole cycle:)", flush=True)
        print(summary(since), flush=True)
    del refs
    for ptr, _ in ranges:
        alloc.free(ptr)
    alloc.close()


if __name__ == "__main__":
    main()
