"""The ``torpor`` command line: one subcommand per module of ``torpor.commands``.

Each module in :data:`COMMANDS` defines ``register(subparsers)`` which adds its
parser and sets ``func(args) -> int``. Errors a user can cause (bad arguments,
unreadable inputs) print one line and exit non-zero, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from torpor import __version__
from torpor.errors import TorporError

#: Subcommand modules under ``torpor.commands``, in --help order.
COMMANDS: tuple[str, ...] = ("demo", "log", "status", "diagram", "dashboard", "plot", "bench")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (subparsers inherit the class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    parser = _Parser(
        prog="torpor",
        description="Put a GPU inference engine to sleep and wake it without losing a byte, and watch it.",
        epilog="example: torpor demo --cycles 3",
    )
    parser.add_argument("--version", action="version", version=f"torpor {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"torpor.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"torpor.commands.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `torpor log show X | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (TorporError, OSError, ValueError) as exc:
        print(f"torpor {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
