"""``torpor plot LOG -o timeline.png``: bytes per tag by residency over time, with state bands, from an event log."""

from __future__ import annotations

import argparse
from pathlib import Path

from torpor.commands import log_file, no_events, output_file
from torpor.extras import require
from torpor.statemachine import read_events
from torpor.telemetry.timeline import plot


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``plot`` subcommand."""
    p = sub.add_parser(
        "plot",
        help="draw an event log's timeline as a PNG",
        description=(
            "Replay an event log and draw bytes per tag by residency (GPU, host, discarded) "
            "over time, with the state as coloured bands (needs matplotlib: the 'plot' extra)."
        ),
        epilog="example: torpor plot /var/log/torpor/default.rank0.jsonl -o timeline.png",
    )
    p.add_argument("log", type=Path, help="an event log file, or a log directory (with --engine/--rank)")
    p.add_argument("-o", "--output", type=Path, default=Path("timeline.png"), help="PNG to write (timeline.png)")
    p.add_argument("--engine", help="engine whose log to plot, in a log directory")
    p.add_argument("--rank", type=int, help="rank whose log to plot, in a log directory")
    p.add_argument("--title", help="figure title")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Draw the timeline and say where it went."""
    require("matplotlib", "drawing the timeline", extra="plot")  # one line naming the extra, not a traceback
    out = output_file(args.output, name="timeline.png", suffix=".png")  # a bad -o is said before the log is read
    log = log_file(args.log, args.engine, args.rank)
    if next(iter(read_events(log)), None) is None:
        raise no_events(log)
    print(f"wrote {plot(log, out, args.title)}")
    return 0
