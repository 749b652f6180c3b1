"""The benchmark's text: one progress line per row, and the Markdown tables of a run."""

from __future__ import annotations

from typing import Any

from torpor.bench.host import host_markdown
from torpor.bench.result import Result
from torpor.units import GiB


def pins_text(r: Result) -> str:
    return f"{r.pinned_awake / GiB:.2f}/{r.pinned_asleep / GiB:.2f}/{r.pinned_after_wake / GiB:.2f} GiB"


def row_line(row: dict[str, Any]) -> str:
    return (
        f"{row['system']:<22} {row['workload']:<22} first {row['first_sleep_s']:.3f}s ({row['first_x']:.2f}x) "
        f"later {row['later_sleep_s']:.3f}s ({row['later_x']:.2f}x) wake {row['wake_s']:.3f}s ({row['wake_x']:.2f}x) "
        f"first wake {row['first_wake_s']:.3f}s ({row['first_wake_x']:.2f}x) "
        f"released {row['released_pct']:.2f}% host {row['host_GiB']:.2f} GiB exact {row['exact']} "
        f"prep {row['prepare_s']:.2f}s {row['note']}"
    )


def markdown(data: dict[str, Any]) -> str:
    """The results table in Markdown."""
    head = (
        "| system | workload | first sleep | later sleep | wake | released | host held | bit-exact |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = []
    for r in data["rows"]:
        if r["note"].startswith("not importable"):
            lines.append(f"| {r['system']} | {r['workload']} | {r['note']} | | | | | |")
            continue
        lines.append(
            f"| {r['system']} | {r['workload']} | {r['first_sleep_s']:.3f} s ({r['first_x']:.2f}x) | "
            f"{r['later_sleep_s']:.3f} s ({r['later_x']:.2f}x) | {r['wake_s']:.3f} s ({r['wake_x']:.2f}x) | "
            f"{r['released_pct']:.2f} % | {r['host_GiB']:.2f} GiB | {'yes' if r['exact'] else 'NO'} |"
        )

    out = head + "\n".join(lines) + "\n"
    out += host_markdown(data)
    return out
