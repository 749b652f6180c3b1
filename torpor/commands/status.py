"""``torpor status DIR``: the engine-wide sleep state merged from the per-rank event logs in DIR."""

from __future__ import annotations

import argparse
import json
import sys

from torpor.commands import seconds
from torpor.commands.writer import writer_running
from torpor.errors import FleetError
from torpor.readmodel.ranklogs import MAX_WORLD_SIZE, EngineView, FleetView, RankView, fleet, wait_fleet
from torpor.statemachine.core.states import TRANSITIONAL
from torpor.units import byte_size

#: The states a rank's log can end in only inside a command (or when its writer died in one).
_MID_COMMAND = frozenset(s.value for s in TRANSITIONAL)
#: Exit status when a rank's log ends inside a transition and its writer is gone.
EXIT_INTERRUPTED = 4

#: States ``--wait`` accepts.
WAIT_STATES = ("awake", "asleep", "asleep_l1", "asleep_l2", "partially_awake", "closed")

EXAMPLE = """\
examples:
  torpor status /var/run/torpor                 every engine logging there, rank by rank
  torpor status /var/run/torpor --engine llm0 --json
  torpor status /var/run/torpor --wait asleep --timeout 60   (exit 0 once all ranks are asleep)

exit status: 0 ok; 1 unreadable logs or a bad directory; 3 --wait timed out;
  4 a rank's log ends inside a transition and its writer is gone (interrupted: recover() it)"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``status`` subcommand."""
    p = sub.add_parser(
        "status",
        help="engine-wide sleep state from per-rank event logs",
        description=(
            "Merge the per-rank event logs (ENGINE.rankN.jsonl) in DIR into one state per engine:\n"
            "asleep when every rank is asleep, awake when every rank is awake, otherwise\n"
            "transitional, naming the rank that moved last and the ranks that lag. Ranks that run\n"
            "as a group show the group's last outcome: consistent, or split and which ranks differ."
        ),
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", metavar="DIR", help="the directory the ranks' SleepControllers log into")
    p.add_argument("--engine", help="only this engine")
    p.add_argument(
        "--world-size",
        type=world_size,
        metavar="N",
        help=f"ranks the engine has, 1..{MAX_WORLD_SIZE} (missing logs count as lagging)",
    )
    p.add_argument("--json", action="store_true", help="print the view as JSON")
    p.add_argument(
        "--wait", choices=WAIT_STATES, metavar="STATE", help=f"block until in STATE ({', '.join(WAIT_STATES)})"
    )
    p.add_argument("--timeout", type=seconds, metavar="SECONDS", help="seconds --wait waits at most (default: forever)")
    p.set_defaults(func=run)


def world_size(text: str) -> int:
    """``--world-size N``: an int from 1 to :data:`~torpor.readmodel.ranklogs.MAX_WORLD_SIZE` (``0``, ``-5`` were taken)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_WORLD_SIZE:
        msg = f"{text!r} is not a number of ranks from 1 to {MAX_WORLD_SIZE}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _tags(engine: EngineView, rank: int) -> str:
    parts = []
    for tag, u in sorted(engine.rank(rank).residency.items()):
        if u.resident:
            parts.append(f"{tag} {byte_size(u.resident)} resident")
        elif u.host:
            parts.append(f"{tag} {byte_size(u.host)} on host")
        elif u.discarded:
            parts.append(f"{tag} {byte_size(u.discarded)} discarded")
    return ", ".join(parts)


def memory_line(r: RankView) -> str:
    """Host memory pinned (and the budget), and what stayed on the device at the last sleep; empty when unknown."""
    parts = []
    budget = r.host_policy.get("budget_bytes")
    if r.pinned_bytes or budget is not None or r.device_asleep:
        pin, after = r.host_policy.get("pin", "?"), r.host_policy.get("after_wake", "?")
        limit = "no budget" if budget is None else f"budget {byte_size(budget)}"
        parts.append(f"host pinned {byte_size(r.pinned_bytes)} ({limit}; pinned {pin}, {after} after wake)")
    d = r.device_asleep
    if d:
        parts.append(
            f"at the last sleep the GPU kept {byte_size(d.get('in_use', 0))} in use: torpor tags {byte_size(d.get('tagged', 0))}, "
            f"untagged {byte_size(d.get('untagged', 0))} (CUDA context, NCCL/cuBLAS, torch's default pool)"
        )
    return "; ".join(parts)


def interrupted_ranks(engine: EngineView) -> list[RankView]:
    """Ranks whose log ends inside a transition while its writer is gone (or not known to run)."""
    return [r for r in engine.ranks if r.state in _MID_COMMAND and r.path is not None and not writer_running(r.pid)]


def summary(engine: EngineView) -> str:
    """The engine's line: its state, the lagging ranks, and whether a transition was interrupted."""
    if engine.state not in _MID_COMMAND:  # a merged state, or transitional (some rank leads, others lag)
        line = engine.summary()
    else:  # every rank in the same transition: nobody lags
        n = len(engine.ranks)
        line = f"engine {engine.engine}: {engine.state}, {n} rank{'s' if n != 1 else ''}"
    gone = interrupted_ranks(engine)
    if gone:
        ranks = ", ".join(f"rank {r.rank} (pid {r.pid})" for r in gone)
        line += f"; INTERRUPTED: the writer of {ranks} is gone mid-command; restart it on its log and call recover()"
    elif any(r.state in _MID_COMMAND for r in engine.ranks):
        line += "; a command is in flight"
    return line


def render(view: FleetView) -> str:
    """The text ``torpor status`` prints: a summary line per engine, then one line per rank."""
    lines = []
    for engine in view.engines:
        lines.append(summary(engine))
        if engine.group is not None:  # ranks that sleep and wake as a group: do they agree?
            lines.append(f"  {engine.group.describe()}")
        for r in engine.ranks:
            where = f"pid {r.pid}" if r.pid else ""
            if r.error is not None:
                lines.append(f"  rank {r.rank:<3} {r.state:<16} {r.error}")
            elif r.path is None:
                expected = f"{engine.engine}.rank{r.rank}.jsonl"
                lines.append(f"  rank {r.rank:<3} {r.state:<16} no log for rank {r.rank} in the directory ({expected})")
            else:
                lines.append(  # a closed rank's since is its closed event (fleet)
                    f"  rank {r.rank:<3} {r.state:<16} since #{r.since:<6} {where:<10} {_tags(engine, r.rank)}".rstrip()
                )
                memory = memory_line(r)
                if memory:
                    lines.append(f"           {memory}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the view (waiting first with --wait); the exit status says whether it is usable."""
    if args.timeout is not None and args.wait is None:
        print("torpor status: --timeout needs --wait", file=sys.stderr)
        return 2
    if args.wait:  # an engine that has not logged yet is waited for (an RL driver may start first)
        reached = wait_fleet(args.directory, args.wait, args.timeout, engine=args.engine, world_size=args.world_size)
        try:
            view = reached or fleet(args.directory, engine=args.engine, world_size=args.world_size)
        except FleetError as exc:  # still no log at the timeout
            print(f"torpor status: not {args.wait} after {args.timeout:g} s: {exc}", file=sys.stderr)
            return 3
    else:
        reached = None
        view = fleet(args.directory, engine=args.engine, world_size=args.world_size)
    if args.json:
        data = view.to_dict()
        for engine, entry in zip(view.engines, data["engines"], strict=True):
            entry["interrupted"] = [r.rank for r in interrupted_ranks(engine)]
        print(json.dumps(data, indent=2))
    else:
        print(render(view))
    if args.wait and reached is None:
        print(f"torpor status: not {args.wait} after {args.timeout:g} s", file=sys.stderr)
        return 3
    if any(e.state == "unknown" for e in view.engines):
        return 1
    return EXIT_INTERRUPTED if any(interrupted_ranks(e) for e in view.engines) else 0
