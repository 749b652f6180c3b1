"""``torpor dashboard [-o FILE]``: write the Grafana dashboard generated from torpor's panel table."""

from __future__ import annotations

import argparse
from pathlib import Path

from torpor.commands import write_output
from torpor.telemetry.grafana import render_dashboard


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``dashboard`` subcommand."""
    p = sub.add_parser(
        "dashboard",
        help="print the Grafana dashboard JSON",
        description="Print (or write) the Grafana dashboard generated from torpor/telemetry/grafana.py.",
        epilog="example: torpor dashboard -o dashboards/torpor.json",
    )
    p.add_argument("-o", "--output", type=Path, help="write to this file instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print or write the dashboard."""
    text = render_dashboard()
    if args.output:
        write_output(args.output, text, name="torpor-dashboard.json")
    else:
        print(text, end="")
    return 0
