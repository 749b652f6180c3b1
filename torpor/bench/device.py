"""Device helpers of the benchmark: raw ranges as tensors, free device bytes, the pinned-copy floor, fill and compare.

torch is imported when a helper runs (``torpor bench`` checks it first), so
importing :mod:`torpor.bench` needs no torch.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from torpor.bench.result import Result
from torpor.units import GiB


class _Raw:
    """A device range as a torch tensor, through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def tensor_at(ptr: int, nbytes: int) -> Any:
    import torch

    return torch.as_tensor(_Raw(ptr, nbytes), device="cuda")


def free_device() -> int:
    import torch

    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def measure_floor(nbytes: int = 2 * GiB, repeats: int = 5) -> tuple[float, float]:
    """Pinned copy bandwidth (bytes/s) device-to-host and host-to-device, best of ``repeats``."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = []
    for src, dst in ((dev, host), (host, dev)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out.append(nbytes / best)
    del dev, host
    torch.cuda.empty_cache()
    return out[0], out[1]


def fill(ranges: list[tuple[int, int]]) -> list[Any]:
    """Fill each range with random bytes; return device clones to compare with after a wake."""
    refs = []
    for ptr, n in ranges:
        t = tensor_at(ptr, n)
        t.random_(0, 256)
        refs.append(t.clone())
    return refs


def same(ranges: list[tuple[int, int]], refs: list[Any]) -> bool:
    import torch

    return all(bool(torch.equal(tensor_at(p, n), r)) for (p, n), r in zip(ranges, refs, strict=True))


def run_record(results: list[Result], d2h: float, h2d: float, cycles: int) -> dict[str, Any]:
    """What every bench JSON starts with: the GPU, torch, the date, the floor, the cycles, the rows and raw results."""
    import torch

    return {
        "machine": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "floor_d2h_Bps": d2h,
        "floor_h2d_Bps": h2d,
        "cycles": cycles,
        "rows": [r.row(d2h, h2d) for r in results],
        "raw": [asdict(r) for r in results],
    }
