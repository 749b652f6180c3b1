"""``torpor keeper``: run a keeper (``serve``), read its state (``status``), drop a dead engine's backup (``drop``)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from decimal import Decimal, InvalidOperation
from typing import Any

from torpor.errors import KeeperUnavailable
from torpor.keeper.daemon import Keeper
from torpor.keeper.link import KeeperLink
from torpor.statemachine.core.timeouts import timeout_seconds
from torpor.units import byte_size

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: The largest budget (the largest byte count the keeper's replies and the event log carry).
MAX_BUDGET = (1 << 63) - 1
#: What argparse takes for the value of --budget rather than for an option: ``-5G`` is a (refused) budget.
_NUMBER_LIKE = re.compile(r"^-\d[\d.]*\s*[a-zA-Z]*$")


def byte_count(text: str) -> int:
    """A byte count: ``1073741824``, ``512M``, ``64G``, ``1.5T`` (powers of 1024; a trailing ``iB`` or ``B`` is fine)."""
    m = re.fullmatch(r"\s*(\d{1,30}(?:\.\d{1,30})?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    try:
        value = int(Decimal(m.group(1)) * _UNITS[m.group(2).lower()]) if m is not None else 0
    except InvalidOperation:
        value = 0
    if not 0 < value <= MAX_BUDGET:
        shown = text if len(text) <= 40 else f"{text[:40]}... ({len(text)} characters)"
        msg = f"{shown!r} is not a positive byte count of at most 8 EiB (say 64G, 512M or 1073741824)"
        raise argparse.ArgumentTypeError(msg)
    return value


def _seconds(text: str) -> float:
    try:
        return timeout_seconds(float(text), "--wait")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``keeper`` subcommand and its actions."""
    p = sub.add_parser(
        "keeper",
        help="hold host backups in a process that outlives the engine",
        description=(
            "A keeper holds engines' host backups in shared memory it owns, so that a backup written by a sleep "
            "survives the engine's death and a new process of the same engine adopts it (docs/keeper.md)."
        ),
        epilog="example: torpor keeper serve --budget 64G &  torpor keeper status --wait 10",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    serve = actions.add_parser(
        "serve",
        help="run a keeper in the foreground",
        description=(
            "Run a keeper in the foreground until SIGTERM or Ctrl-C (exit 130); its backups go with it. It refuses "
            "a path that holds anything but a socket no keeper answers, a directory another user owns or may write, "
            "and a path another keeper holds; a missing directory is made private (0700)."
        ),
        epilog="example: torpor keeper serve --budget 64G",
    )
    serve._negative_number_matcher = _NUMBER_LIKE  # `--budget -5G` is a refused budget, not a missing one
    serve.add_argument("--socket", help="the socket (default: $TORPOR_KEEPER_SOCKET or a private per-user directory)")
    serve.add_argument("--budget", type=byte_count, default=byte_count("64G"), help="most bytes held (default 64G)")
    serve.set_defaults(func=run_serve)
    status = actions.add_parser(
        "status",
        help="engines, backups (tags, bytes, age, model), budget",
        description=(
            "Print a keeper's state: its budget and the bytes it holds, the engines it has heard from (alive or "
            "dead), each backup (tags, size, age, model) and the last adoptions."
        ),
        epilog="example: torpor keeper status --wait 10",
    )
    status.add_argument("--socket", help="the keeper's socket")
    status.add_argument("--json", action="store_true", help="print the state as JSON")
    status.add_argument(
        "--wait", type=_seconds, default=0.0, metavar="SECONDS", help="wait up to SECONDS for a keeper to answer"
    )
    status.set_defaults(func=run_status)
    drop = actions.add_parser(
        "drop",
        help="drop a dead engine's backup",
        description=(
            "Drop the backup of an engine whose process is gone, freeing its memory; a live engine's backup is "
            "refused (it retracts its own when it wakes)."
        ),
        epilog="example: torpor keeper drop qwen-0",
    )
    drop.add_argument("engine", help="the engine's name")
    drop.add_argument("--socket", help="the keeper's socket")
    drop.set_defaults(func=run_drop)

    def usage(args: argparse.Namespace) -> int:
        print(f"{p.prog}: error: say which action: serve, status or drop (see {p.prog} --help)", file=sys.stderr)
        return 2

    p.set_defaults(func=usage)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; the socket goes with it (the backups too)."""
    keeper = Keeper(args.socket, args.budget)
    keeper.bind()
    signal.signal(signal.SIGTERM, lambda *_: keeper.close())
    print(f"torpor keeper: pid {keeper.status()['keeper_pid']} serving {keeper.path}, budget {byte_size(args.budget)}")
    sys.stdout.flush()
    try:
        keeper.serve()
    finally:
        keeper.close()
    return 0


def _age(seconds: float) -> str:
    return (
        f"{seconds:.0f} s"
        if seconds < 120
        else f"{seconds / 60:.0f} min"
        if seconds < 7200
        else f"{seconds / 3600:.1f} h"
    )


def shown(value: object) -> str:
    """``value`` as text with every character that is not printable escaped (``\\n``, ``\\x1b``): one line, inert."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def format_status(state: dict[str, Any]) -> str:
    """The keeper's state as lines an operator reads (every name from the keeper escaped: one line each)."""
    lines = [
        f"keeper pid {state['keeper_pid']} at {shown(state['socket'])} (uid {state['uid']}, "
        f"up {_age(state['uptime_s'])})",
        f"holds {byte_size(state['used'])} of {byte_size(state['budget'])} in {state['regions']} regions",
    ]
    now = time.time()
    engines = state["engines"]
    lines.append(f"engines: {len(engines)}" if engines else "engines: none")
    for e in engines:
        life = "alive" if e["alive"] else f"dead {_age(now - e['ended'])} ago"
        lines.append(f"  {shown(e['engine'])}: pid {e['pid']}, {life}")
    backups = state["backups"]
    lines.append(f"backups: {len(backups)}" if backups else "backups: none")
    for b in backups:
        adopter = f", being adopted by pid {b['adopter']}" if b["adopter"] else ""
        tags = ",".join(shown(t) for t in b["tags"]) or "-"
        lines.append(
            f"  {shown(b['backup'])}: engine {shown(b['engine'])}, pid {b['pid']}, tags {tags}, "
            f"{byte_size(b['bytes'])}, age {_age(b['age_s'])}, model {shown(b['model'])}{adopter}"
        )
    for a in state["adoptions"]:
        lines.append(
            f"adopted: {shown(a['backup'])} (engine {shown(a['engine'])}) from dead pid {a['from_pid']} by pid "
            f"{a['by_pid']}, {byte_size(a['bytes'])} in {a['seconds']:.3f} s"
        )
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    """Print the keeper's state (waiting up to --wait seconds for a keeper to answer)."""
    deadline = time.monotonic() + args.wait
    while True:
        try:
            with KeeperLink(args.socket) as link:
                state = link.status()
            break
        except KeeperUnavailable:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
    print(json.dumps(state, indent=2) if args.json else format_status(state))
    return 0


def run_drop(args: argparse.Namespace) -> int:
    """Drop a dead engine's backup."""
    with KeeperLink(args.socket) as link:
        dropped = link.drop(args.engine)
    print(f"dropped backup {shown(dropped['dropped'])} ({byte_size(dropped['bytes'])})")
    return 0
