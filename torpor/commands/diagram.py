"""``torpor diagram``: print the state diagram (Mermaid) generated from the transition table."""

from __future__ import annotations

import argparse
from pathlib import Path

from torpor.commands import write_output
from torpor.statemachine.core.states import diagram_markdown, mermaid


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``diagram`` subcommand."""
    p = sub.add_parser(
        "diagram",
        help="print the state diagram in Mermaid",
        description="Print the Mermaid state diagram generated from torpor's transition table.",
        epilog="example: torpor diagram --markdown -o docs/state-diagram.md",
    )
    p.add_argument("--markdown", action="store_true", help="wrap it as the docs page")
    p.add_argument("-o", "--output", type=Path, help="write to this file instead of stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print or write the diagram."""
    text = diagram_markdown() if args.markdown else mermaid()
    if args.output:
        write_output(args.output, text, name="state-diagram.md")
    else:
        print(text, end="")
    return 0
