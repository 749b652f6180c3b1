"""Plot time against bytes and against segment count from a ``torpor bench`` JSON (writes PNGs under docs/bench/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

GiB = 1 << 30


def plot(data: dict, out: Path) -> list[Path]:
    """One PNG per sweep axis: later sleep and wake of torpor and the baseline, with the floor."""
    d2h, h2d = data["floor_d2h_Bps"], data["floor_h2d_Bps"]
    written = []
    for axis, xkey, xlabel in (
        ("bytes", "GiB", "GiB backed up (128 MiB segments)"),
        ("segments", "segments", "segments (2 GiB in total)"),
    ):
        rows = [r for r in data["sweeps"] if r.get("axis") == axis]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for system, color in (("torpor", "tab:blue"), ("vllm-style", "tab:orange")):
            pts = sorted(
                (r[xkey], r["later_sleep_s"], r["wake_s"], r["first_sleep_s"]) for r in rows if r["system"] == system
            )
            xs = [p[0] for p in pts]
            ax.plot(xs, [p[3] for p in pts], "^:", color=color, alpha=0.6, label=f"{system} first sleep")
            ax.plot(xs, [p[1] for p in pts], "o-", color=color, label=f"{system} sleep (later)")
            ax.plot(xs, [p[2] for p in pts], "s--", color=color, label=f"{system} wake")
        xs = sorted({r[xkey] for r in rows})
        floor = [(x * GiB if axis == "bytes" else 2 * GiB) / d2h for x in xs]
        ax.plot(xs, floor, "k:", label=f"floor (D2H {d2h / 1e9:.0f} GB/s)")
        _ = h2d
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"sleep/wake time vs {axis} ({data['machine']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"allocator-time-vs-{axis}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "out/bench/bench.json")
    dest = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/bench")
    dest.mkdir(parents=True, exist_ok=True)
    for p in plot(json.loads(src.read_text()), dest):
        print(p)
