"""The ``torpor`` command line: one subcommand per module of ``torpor.commands``.

Each module in :data:`COMMANDS` defines ``register(subparsers)`` which adds its
parser and sets ``func(args) -> int``. Errors a user can cause (bad arguments,
unreadable inputs) print one line and exit non-zero, never a traceback.

One exit-status convention for every command (docs/cli.md, "Exit status"):
0 done; 1 the command failed (a missing, unreadable, empty or corrupted input, a
check that did not pass, what it needs is not here); 2 a usage error, reported
by the command that was misused; 3 ``status --wait`` timed out; 4 a log ends
inside a transition whose writer is gone; 130 Ctrl-C; 141 the reader of stdout
left before the command finished (128 + SIGPIPE, as ``yes | head`` gives).
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

#: Exit status when the reader of stdout leaves early (128 + SIGPIPE, what a shell reports for ``yes | head``).
EXIT_BROKEN_PIPE = 141

#: Subcommand modules under ``torpor.commands``, in --help order.
COMMANDS: tuple[str, ...] = ("demo", "log", "status", "diagram", "dashboard", "plot", "bench", "keeper")


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
    _name_parsers(parser)
    return parser


def _name_parsers(parser: argparse.ArgumentParser) -> None:
    """Each (sub)parser records itself in the namespace, so an unknown option is reported by the command it follows."""
    parser.set_defaults(_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _name_parsers(child)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # `torpor demo --level 3`: demo's usage error, not the top level's
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `torpor demo | head`: the reader left before the end; not done, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (TorporError, OSError, ValueError) as exc:
        print(f"torpor {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
