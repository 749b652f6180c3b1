"""Host-memory parts of ``torpor bench``: the modes compared, pageable copy bandwidth, and their Markdown table.

Each mode is the same workload under one :class:`HostMemoryPolicy` (when host
memory is pinned, whether it is kept after a wake); the rows give first and
later sleep, wake, and the pinned host bytes awake before the first sleep,
asleep, and after the wake. docs/benchmarks.md reads the default off them.
"""

from __future__ import annotations

import time
from typing import Any

from torpor.statemachine.core.policy import AfterWake, HostMemoryPolicy, PinWhen
from torpor.units import GiB

HOST_MODES: tuple[HostMemoryPolicy, ...] = (
    HostMemoryPolicy(PinWhen.AHEAD, AfterWake.KEEP),
    HostMemoryPolicy(PinWhen.AT_SLEEP, AfterWake.KEEP),
    HostMemoryPolicy(PinWhen.AT_SLEEP, AfterWake.RELEASE),
    HostMemoryPolicy(PinWhen.AHEAD, AfterWake.RELEASE),
)
"""The host-memory modes the benchmark compares on the same workloads (the default is the second)."""


def measure_pageable(nbytes: int = 2 * GiB) -> dict[str, float]:
    """Device-to-host copy bandwidth into pageable memory (what a sleep over budget could fall back to), fresh and reused."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, float] = {}
    host = torch.empty(nbytes, dtype=torch.uint8)  # pageable, not touched yet
    for key in ("fresh_Bps", "reused_Bps"):
        torch.cuda.synchronize()
        t = time.perf_counter()
        host.copy_(dev)
        torch.cuda.synchronize()
        out[key] = nbytes / (time.perf_counter() - t)
    del dev, host
    torch.cuda.empty_cache()
    return out


def host_markdown(data: dict[str, Any]) -> str:
    """The host-mode table and the pageable-copy line of a benchmark run, in Markdown ('' when absent)."""
    out = ""
    modes = data.get("host_modes") or []
    if modes:
        out += (
            "\nHost-memory modes (pin, after wake), 3 cycles each; pinned host GiB awake before the first sleep, "
            "asleep, and after wake:\n\n"
            "| mode | workload | first sleep | later sleep | wake | pinned awake | asleep | after wake | bit-exact |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
        )
        for r in modes:
            out += (
                f"| {r['host_mode']} | {r['workload']} | {r['first_sleep_s']:.3f} s ({r['first_x']:.2f}x) | "
                f"{r['later_sleep_s']:.3f} s ({r['later_x']:.2f}x) | {r['wake_s']:.3f} s ({r['wake_x']:.2f}x) | "
                f"{r['pinned_awake_GiB']:.2f} | {r['pinned_asleep_GiB']:.2f} | {r['pinned_after_wake_GiB']:.2f} | "
                f"{'yes' if r['exact'] else 'NO'} |\n"
            )
    if data.get("pageable_d2h"):
        p = data["pageable_d2h"]
        out += (
            f"\nPageable D2H (an over-budget fallback): {p['fresh_Bps'] / 1e9:.1f} GB/s into fresh pages, "
            f"{p['reused_Bps'] / 1e9:.1f} GB/s reused; pinned floor {data['floor_d2h_Bps'] / 1e9:.1f} GB/s. "
            f"Transparent huge pages: {data.get('transparent_huge_pages')}.\n"
        )
    return out
