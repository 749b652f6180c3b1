"""The vLLM bench's rows against the pinned host-link floor, measured once per run as the synthetic bench measures it.

:func:`floor_in_child` runs :func:`torpor.bench.device.measure_floor` (best of
five pinned 2 GiB copies each way) in a child process on the same GPU before
the engines start: the driver then holds no CUDA context and no pinned host
cache while they run (a cache left in an engine's process would serve its
backend's first pinned backup). :func:`against_floor` sets each row of the
table against the least time the link needs for what that step moves: the
model's parameters and buffers (``model_bytes``, read in each engine's worker)
to the host on a level-1 sleep and back on its wake and on a level-2 wake with
its reload; the buffers alone on a level-2 sleep, which discards the weights
and saves the buffers. The CUDA-graph pool, also offloaded, is not counted:
the floor is a lower bound, and a ratio near 1 is the link's speed.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from torpor.errors import BenchError

__all__ = ["FLOOR_BYTES", "against_floor", "floor_in_child", "floor_lines"]

#: Per row of the table: the link direction and which of the model's bytes that step moves.
FLOOR_BYTES: dict[str, tuple[str, tuple[str, ...]]] = {
    "l1_sleep_first_s": ("d2h", ("parameters", "buffers")),
    "l1_sleep_later_s": ("d2h", ("parameters", "buffers")),
    "l1_wake_first_s": ("h2d", ("parameters", "buffers")),
    "l1_wake_later_s": ("h2d", ("parameters", "buffers")),
    "l2_sleep_s": ("d2h", ("buffers",)),
    "l2_wake_reload_s": ("h2d", ("parameters", "buffers")),
}

_CHILD = "import json; from torpor.bench.device import measure_floor; print(json.dumps(measure_floor()))"


def floor_in_child(env: Mapping[str, str] | None = None, timeout: float = 300.0) -> tuple[float, float]:
    """Pinned copy bandwidth (bytes/s) to the host and back, measured by ``measure_floor`` in a child process."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=dict(os.environ if env is None else env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        msg = f"measuring the host-link floor failed (exit {done.returncode}): {tail}"
        raise BenchError(msg)
    d2h, h2d = json.loads(done.stdout.strip().splitlines()[-1])
    return float(d2h), float(h2d)


def _model_bytes(runs: list[dict[str, Any]], backend: str) -> dict[str, float]:
    """The median over ``backend``'s engines of the model's bytes by kind (the same model: the same figure)."""
    sizes = [r["model_bytes"] for r in runs if r.get("backend") == backend and r.get("model_bytes")]
    kinds = {kind for size in sizes for kind in size}
    return {kind: statistics.median(float(size.get(kind, 0)) for size in sizes) for kind in kinds}


def against_floor(
    summary: Mapping[str, Mapping[str, Any]], runs: list[dict[str, Any]], d2h: float, h2d: float
) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per backend and row: ``floor_s`` (the bytes moved over the measured link) and ``x`` (the row's median over it)."""
    link = {"d2h": d2h, "h2d": h2d}
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for backend, row in summary.items():
        sizes = _model_bytes(runs, backend)
        out[backend] = {}
        for key, (direction, kinds) in FLOOR_BYTES.items():
            moved = sum(sizes.get(kind, 0.0) for kind in kinds)
            floor_s = moved / link[direction] if moved and link[direction] > 0 else None
            seconds = row.get(key)
            x = seconds / floor_s if floor_s and seconds is not None else None
            out[backend][key] = {"floor_s": floor_s, "x": x}
    return out


def floor_lines(data: Mapping[str, Any], rows: Mapping[str, str]) -> list[str]:
    """The table of each row's floor and each backend's multiple of it (none when the run measured no floor)."""
    floor = data.get("floor")
    if not floor:
        return []
    backends = list(floor)
    lines = [
        "",
        f"Against the pinned host-link floor measured in this run: {data['floor_d2h_Bps'] / 1e9:.1f} GB/s to host, "
        f"{data['floor_h2d_Bps'] / 1e9:.1f} GB/s back (the model's parameters and buffers each step moves; "
        "a level-2 sleep saves only the buffers; the graph pool is not counted):",
        "",
        "| row | floor | " + " | ".join(f"`{b}`" for b in backends) + " |",
        "| --- | --- | " + " | ".join("---" for _ in backends) + " |",
    ]
    for key, name in rows.items():
        floor_s = next((floor[b][key]["floor_s"] for b in backends if floor[b][key]["floor_s"]), None)
        cells = ["n/a" if floor[b][key]["x"] is None else f"{floor[b][key]['x']:.2f}x" for b in backends]
        lines.append(f"| {name} | {'n/a' if floor_s is None else f'{floor_s:.3f} s'} | " + " | ".join(cells) + " |")
    return lines
