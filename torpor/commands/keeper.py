"""``torpor keeper``: run a keeper (``serve``), read its state (``status``), drop a dead engine's backup (``drop``)."""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from typing import Any

from torpor.keeper.daemon import Keeper
from torpor.keeper.keeperclient import KeeperLink

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_count(text: str) -> int:
    """A byte count: ``1073741824``, ``512M``, ``64G``, ``1.5T`` (powers of 1024; a trailing ``iB`` or ``B`` is fine)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        msg = f"{text!r} is not a positive byte count (say 64G, 512M or 1073741824)"
        raise argparse.ArgumentTypeError(msg)
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``keeper`` subcommand and its actions."""
    p = sub.add_parser(
        "keeper",
        help="hold host backups in a process that outlives the engine",
        description=(
            "A keeper holds engines' host backups in shared memory it owns, so that a backup written by a sleep "
            "survives the engine's death and a new process of the same engine adopts it (docs/keeper.md)."
        ),
        epilog="example: torpor keeper serve --budget 64G &  torpor keeper status",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    serve = actions.add_parser(
        "serve", help="run a keeper in the foreground", epilog="example: torpor keeper serve --budget 64G"
    )
    serve.add_argument("--socket", help="the socket (default: $TORPOR_KEEPER_SOCKET or a private per-user directory)")
    serve.add_argument("--budget", type=byte_count, default=byte_count("64G"), help="most bytes held (default 64G)")
    serve.set_defaults(func=run_serve)
    status = actions.add_parser(
        "status", help="engines, backups (tags, bytes, age, model), budget", epilog="example: torpor keeper status"
    )
    status.add_argument("--socket", help="the keeper's socket")
    status.add_argument("--json", action="store_true", help="print the state as JSON")
    status.set_defaults(func=run_status)
    drop = actions.add_parser("drop", help="drop a dead engine's backup", epilog="example: torpor keeper drop qwen-0")
    drop.add_argument("engine", help="the engine's name")
    drop.add_argument("--socket", help="the keeper's socket")
    drop.set_defaults(func=run_drop)

    def usage(args: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=usage)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; the socket goes with it (the backups too)."""
    keeper = Keeper(args.socket, args.budget)
    keeper.bind()
    signal.signal(signal.SIGTERM, lambda *_: keeper.close())
    print(f"torpor keeper: pid {keeper.status()['keeper_pid']} serving {keeper.path}, budget {args.budget} bytes")
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


def format_status(state: dict[str, Any]) -> str:
    """The keeper's state as lines an operator reads."""
    lines = [
        f"keeper pid {state['keeper_pid']} at {state['socket']} (uid {state['uid']}, up {_age(state['uptime_s'])})",
        f"holds {state['used']} of {state['budget']} bytes in {state['regions']} regions",
    ]
    now = time.time()
    engines = state["engines"]
    lines.append(f"engines: {len(engines)}" if engines else "engines: none")
    for e in engines:
        life = "alive" if e["alive"] else f"dead {_age(now - e['ended'])} ago"
        lines.append(f"  {e['engine']}: pid {e['pid']}, {life}")
    backups = state["backups"]
    lines.append(f"backups: {len(backups)}" if backups else "backups: none")
    for b in backups:
        adopter = f", being adopted by pid {b['adopter']}" if b["adopter"] else ""
        lines.append(
            f"  {b['backup']}: engine {b['engine']}, pid {b['pid']}, tags {','.join(b['tags']) or '-'}, "
            f"{b['bytes']} bytes, age {_age(b['age_s'])}, model {b['model']}{adopter}"
        )
    for a in state["adoptions"]:
        lines.append(
            f"adopted: {a['backup']} (engine {a['engine']}) from dead pid {a['from_pid']} by pid {a['by_pid']}, "
            f"{a['bytes']} bytes in {a['seconds']:.3f} s"
        )
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    """Print the keeper's state."""
    with KeeperLink(args.socket) as link:
        state = link.status()
    print(json.dumps(state, indent=2) if args.json else format_status(state))
    return 0


def run_drop(args: argparse.Namespace) -> int:
    """Drop a dead engine's backup."""
    with KeeperLink(args.socket) as link:
        dropped = link.drop(args.engine)
    print(f"dropped backup {dropped['dropped']} ({dropped['bytes']} bytes)")
    return 0
