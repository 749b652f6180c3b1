"""The whole ``torpor bench`` run: every workload on every system, the host-memory modes, the sweeps for the plots."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torpor.allocator import TaggedAllocator, transparent_huge_pages
from torpor.bench.device import measure_floor, run_record
from torpor.bench.host import HOST_MODES, measure_pageable
from torpor.bench.interference import measure_pinning_interference
from torpor.bench.realmodel import run_real_model
from torpor.bench.report import pins_text, row_line
from torpor.bench.result import Result
from torpor.bench.systems import run_baseline_raw, run_tms_raw, run_torpor_graphs, run_torpor_raw
from torpor.bench.tmsbackends import TMS_BACKENDS, check_backends, disk_parent
from torpor.units import GiB, MiB


def run(
    cycles: int = 4,
    sweep: bool = True,
    tms: bool = True,
    log: Callable[[str], None] = print,
    save: Callable[[dict[str, Any]], None] | None = None,
    tms_backends: Sequence[str] = TMS_BACKENDS,
    disk_dir: Path | None = None,
) -> dict[str, Any]:
    """Every workload on every system, plus the sweeps for the plots; returns a JSON-ready dict (``save``: after each part).

    ``tms_backends`` and ``disk_dir``: the real-model rows' torch_memory_saver backends (checked before anything runs).
    """
    import torch

    tms_backends = check_backends(tms_backends)
    if "disk" in tms_backends:
        disk_dir = disk_parent(disk_dir)

    d2h, h2d = measure_floor()
    log(f"floor: pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s")
    log(f"transparent huge pages: {transparent_huge_pages()}; {os.cpu_count()} CPUs")
    results: list[Result] = []
    main = [("8 GiB / 64", 64, 128 * MiB), ("4 GiB / 2048 x 2 MiB", 2048, 2 * MiB)]
    for name, n, size in main:
        for runner in (run_torpor_raw, run_baseline_raw) + ((run_tms_raw,) if tms else ()):
            r = runner(name, n, size, 2 if runner is run_tms_raw else cycles)
            results.append(r)
            log(row_line(r.row(d2h, h2d)))
            gc.collect()
            torch.cuda.empty_cache()

    modes: list[Result] = []
    for name, n, size in main:
        for host in HOST_MODES:
            r = run_torpor_raw(name, n, size, 3, host=host)
            r.system = f"torpor ({r.host_mode})"
            modes.append(r)
            log(row_line(r.row(d2h, h2d)) + f" pinned awake/asleep/after wake {pins_text(r)}")
            gc.collect()
            torch.cuda.empty_cache()
    pageable = measure_pageable()
    log("pageable D2H: fresh {:.1f} GB/s, reused {:.1f} GB/s".format(*(v / 1e9 for v in pageable.values())))
    flat = TaggedAllocator(slab_bytes=0)
    r = run_torpor_raw("4 GiB / 2048 x 2 MiB", 2048, 2 * MiB, cycles, flat)
    r.system = "torpor (no slabs)"
    flat.close()
    results.append(r)
    log(row_line(r.row(d2h, h2d)))
    r = run_torpor_graphs(cycles)
    results.append(r)
    log(row_line(r.row(d2h, h2d)))
    gc.collect()
    torch.cuda.empty_cache()
    for r in run_real_model(cycles, tms, tms_backends, disk_dir):  # a transformers model: weights + graph + KV
        results.append(r)
        log(row_line(r.row(d2h, h2d)))
    interference = measure_pinning_interference()
    log(
        "awake step while pinning {pin_bytes} B ahead ({pin_s:.1f} s): median {busy_median_ms:.3f} ms "
        "vs idle {idle_median_ms:.3f} ms ({slowdown_median:.2f}x), p99 {busy_p99_ms:.3f} vs {idle_p99_ms:.3f} ms "
        "({busy_steps} and {idle_steps} steps)".format(**interference)
    )
    sweeps: list[dict[str, Any]] = []

    def snapshot() -> dict[str, Any]:
        return {
            **run_record(results, d2h, h2d, cycles),
            "sweeps": sweeps,
            "awake_interference": interference,
            "host_modes": [r.row(d2h, h2d) for r in modes],
            "pageable_d2h": pageable,
            "transparent_huge_pages": transparent_huge_pages(),
            "cpus": os.cpu_count(),
        }

    if save is not None:
        save(snapshot())
    if sweep:
        shared = TaggedAllocator()
        points = [("bytes", GiB * k // (128 * MiB), 128 * MiB) for k in (1, 2, 4, 8)]
        points += [("segments", n, 2 * GiB // n) for n in (16, 128, 1024)]
        for axis, n, size in points:
            r = run_torpor_raw(f"sweep {axis}", n, size, 3, shared)
            b = run_baseline_raw(f"sweep {axis}", n, size, 3, keep_host_cache=axis == "bytes")
            for res in (r, b):
                row = res.row(d2h, h2d)
                row["axis"] = axis
                sweeps.append(row)
                log(row_line(row))
            gc.collect()
            torch.cuda.empty_cache()
        torch._C._host_emptyCache()
        shared.close()
    return snapshot()
