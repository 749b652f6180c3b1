"""Does pinning ahead slow the awake engine? Step times of engine-like work idle and while host memory is pinned."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from torpor.allocator import CudaDriver, HostArena, HostPolicy
from torpor.units import GiB


def engine_step() -> Callable[[], float]:
    """A warmed-up engine-like step that returns its seconds: the awake work background pinning must not hold up.

    One step: a 16 MiB pinned input copy, a 4096x4096 bf16 matmul, 32 small
    kernels, synchronize.
    """
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.zeros(1 << 18, device="cuda")
    host_in = torch.randn(4 << 20, pin_memory=True)
    dev_in = torch.empty_like(host_in, device="cuda")

    def step() -> float:
        t = time.perf_counter()
        dev_in.copy_(host_in, non_blocking=True)
        torch.mm(a, a)
        for _ in range(32):
            small.add_(1.0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(50):
        step()
    return step


def measure_pinning_interference(pin_bytes: int = 8 * GiB, steps: int = 300) -> dict[str, Any]:
    """Step times of engine-like work (a bf16 matmul, 32 small kernels, a 16 MiB input copy) idle and during pinning.

    The background pinning thread competes with the engine for the driver and
    host memory bandwidth; this measures the step time (median and 99th
    percentile, each step synchronized) with no pinning, then while a
    :class:`HostArena` pins ``pin_bytes`` ahead, as after a model load.
    """
    step = engine_step()
    idle = [step() for _ in range(steps)]
    arena = HostArena(CudaDriver(), HostPolicy(prepin=True))
    t0 = time.perf_counter()
    arena.want(pin_bytes)
    busy: list[float] = []
    while not arena.wait_ready(0) or len(busy) < 20:
        busy.append(step())
        if time.perf_counter() - t0 > 120:
            break
    pin_s = time.perf_counter() - t0
    pinned = arena.pinned_bytes()
    arena.close()

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "pin_bytes": pinned,
        "pin_s": pin_s,
        "idle_steps": len(idle),
        "busy_steps": len(busy),
        "idle_median_ms": 1e3 * statistics.median(idle),
        "idle_p99_ms": 1e3 * pct(idle, 0.99),
        "busy_median_ms": 1e3 * statistics.median(busy),
        "busy_p99_ms": 1e3 * pct(busy, 0.99),
        "slowdown_median": statistics.median(busy) / statistics.median(idle),
    }
