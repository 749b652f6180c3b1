"""``torpor log show|follow|replay PATH``: read an event log as a human timeline, live, or as its projection."""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torpor.commands import log_file, no_events, seconds
from torpor.commands.writer import writer_running
from torpor.errors import NoEventLog
from torpor.statemachine import Event, EventKind, Projection, read_events
from torpor.statemachine.log.follow import Follower
from torpor.statemachine.log.logsource import wall_problem
from torpor.statemachine.projection.view import project
from torpor.textout import fmt_seconds, table
from torpor.units import byte_size

#: What a directory holding several logs asks of the user (the log commands take no --engine or --rank).
_PICK_ONE = "name one of them"

#: Payload fields (and members of mapping fields) that hold byte counts, printed as sizes.
_BYTES_FIELDS = frozenset(
    {
        "bytes",
        "freed",
        "offloaded",
        "discarded",
        "restored",
        "pinned",
        "kept",
        "checked",
        "host_budget",
        "host_released",
    }
    | {"device", "budget_bytes", "in_use", "tagged", "untagged", "total", "host"}
)
#: Text fields that quote byte counts (a refusal's ``holders``: ``backup of weights (asleep): 8388608 bytes``).
_TEXT_WITH_BYTES = frozenset({"holders", "reason"})
#: A byte count quoted in text: digits, then ``bytes`` or ``B``.
_QUOTED_BYTES = re.compile(r"\b(\d+) (?:bytes|B)\b")
#: Longest field value printed whole on a timeline line.
_MAX_FIELD = 160
#: Payload fields printed first, in this order; the rest follow alphabetically.
_FIRST = ("tag", "site", "command", "level", "tags", "action", "source", "bytes", "freed", "offloaded", "discarded")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``log`` subcommand and its ``show``, ``follow`` and ``replay`` actions."""
    p = sub.add_parser(
        "log",
        help="read an event log: timeline, live tail, or replayed state",
        description="Read a torpor event log (a .jsonl file, or a directory holding one).",
        epilog="example: torpor log show /tmp/torpor-demo/demo.rank0.jsonl",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    p.set_defaults(func=lambda args: _usage())

    show = actions.add_parser(
        "show",
        help="print the log as a timeline (seq, time, state, kind, key fields)",
        description="Print every event of the log, oldest first, one line each.",
        epilog="example: torpor log show /tmp/torpor-demo --kind sleep_completed --kind wake_completed",
    )
    _add_path(show)
    show.add_argument("--after", type=sequence, default=0, metavar="SEQ", help="only events after this sequence number")
    show.add_argument(
        "--kind", action="append", choices=[k.value for k in EventKind], metavar="KIND", help="only this kind (repeat)"
    )
    _add_json(show)
    show.set_defaults(func=run_show)

    follow = actions.add_parser(
        "follow",
        help="print events as they are appended (tail -f)",
        description="Print the last events of the log, then each new one as it is appended; "
        "survives rotation. Stop with Ctrl-C.",
        epilog="example: torpor log follow /tmp/torpor-demo --after 0",
    )
    _add_path(follow)
    follow.add_argument("-n", "--lines", type=int, default=10, metavar="N", help="old events to print first (10)")
    follow.add_argument("--after", type=sequence, metavar="SEQ", help="start after this sequence number (overrides -n)")
    follow.add_argument(
        "--timeout", type=seconds, metavar="SECONDS", help="stop after this long with no new event (default: never)"
    )
    follow.add_argument("--interval", type=seconds, default=0.2, metavar="SECONDS", help=argparse.SUPPRESS)
    _add_json(follow)
    follow.set_defaults(func=run_follow)

    rep = actions.add_parser(
        "replay",
        help="fold the log into its state and per-tag residency",
        description="Replay the log and print the state it ends in, per-tag residency and, when the "
        "log ends mid-transition, the interrupted step and how to recover.",
        epilog="example: torpor log replay /tmp/torpor-demo/demo.rank0.jsonl",
    )
    _add_path(rep)
    rep.add_argument("--json", action="store_true", help="print the projection as JSON")
    rep.set_defaults(func=run_replay)


def sequence(text: str) -> int:
    """``--after SEQ``: a sequence number, an int >= 0 (0: from the first event; ``-5`` was taken)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 2**63 - 1:
        msg = f"{text!r} is not a sequence number (an int >= 0; 0 means from the first event)"
        raise argparse.ArgumentTypeError(msg)
    return value


def _add_path(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, metavar="PATH", help="event log file, or a directory holding one")


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        help="print each event as one JSON object per line (NDJSON, the shape of the endpoints' /events)",
    )


def _usage() -> int:
    """One line: which actions there are (a usage error, exit 2)."""
    print("torpor log: error: name an action: show, follow or replay (see torpor log --help)", file=sys.stderr)
    return 2


# -- formatting ------------------------------------------------------------------------


def _sizes_in(text: str) -> str:
    """``text`` with each byte count it quotes (``8388608 bytes``, ``8388608 B``) as a size (``8.00 MiB``)."""
    return _QUOTED_BYTES.sub(lambda m: byte_size(int(m.group(1))), text)


def _value(name: str, value: Any) -> str:
    if name in _BYTES_FIELDS and isinstance(value, int):
        return byte_size(value)
    if name in _TEXT_WITH_BYTES and isinstance(value, str):
        return _sizes_in(value)
    if name == "seconds" and isinstance(value, int | float):
        return fmt_seconds(float(value))
    if isinstance(value, Mapping):  # a byte field's members are bytes; otherwise each member by its own name
        return (
            "{"
            + ", ".join(f"{k}: {_value(name if name in _BYTES_FIELDS else str(k), v)}" for k, v in value.items())
            + "}"
        )
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_value(name, v) if isinstance(v, str) else str(v) for v in value) + "]"
    return str(value)


def describe(event: Event) -> str:
    """The key fields of one event, ``name=value`` separated by spaces."""
    data = dict(event.data)
    parts: list[str] = []
    usage = data.pop("usage", None)
    data.pop("projection", None)
    order = [n for n in _FIRST if n in data] + sorted(n for n in data if n not in _FIRST)
    if event.kind is EventKind.REFUSED:
        data.pop("state", None)  # the state column says it
        if data.get("holders") and len(str(data.get("reason", ""))) > _MAX_FIELD:
            data.pop("reason")  # the holders say it shorter
    for name in order:
        value = data.get(name)
        if value is None or value in ("", (), []):
            continue
        text = _value(name, value)
        if len(text) > _MAX_FIELD:
            text = text[: _MAX_FIELD - 1] + "…"
        parts.append(f"{name}={text}")
    if isinstance(usage, Mapping):
        total = sum(int(v) for v in usage.values())
        parts.append(f"resident={byte_size(total)} in {len(usage)} tag(s)")
    return " ".join(parts)


#: Exit status of ``torpor log replay`` for a log that ends inside a transition whose writer is gone.
EXIT_INTERRUPTED = 4


def _stamp(event: Event) -> str:
    """``HH:MM:SS.mmm`` of the event's wall time; ``??:??:??.???`` when it is no date (see :func:`wall_problem`)."""
    if wall_problem(event) is not None:
        return "??:??:??.???"
    return time.strftime("%H:%M:%S", time.localtime(event.wall)) + f".{int(event.wall * 1000) % 1000:03d}"


def _bad_walls(command: str, problems: list[str]) -> int:
    """Say why the log is bad (the first problem and how many) on stderr; the exit status 1."""
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    print(f"torpor log {command}: {problems[0]}{more}; the log is bad", file=sys.stderr)
    return 1


def timeline_line(event: Event, state: str) -> str:
    """One row of the human timeline."""
    stamp = _stamp(event)
    return f"#{event.seq:<5} {stamp}  {state:<15} {event.kind.value:<16} {describe(event)}".rstrip()


def _header(path: Path, out: Callable[[str], None]) -> None:
    out(f"event log {path}")
    out(f"{'seq':<6} {'time':<12}  {'state after':<15} {'kind':<16} details")


# -- actions ----------------------------------------------------------------------------


def run_show(args: argparse.Namespace) -> int:
    """Print the timeline."""
    path = log_file(args.path, hint=_PICK_ONE)
    kinds = set(args.kind or ())
    events = list(read_events(path))  # a corrupted line fails before anything is printed
    if not events:
        raise no_events(path)
    proj = Projection()
    if not args.json:
        _header(path, print)
    problems = [p for p in map(wall_problem, events) if p is not None]
    for event in events:
        proj.apply(event)
        if event.seq <= args.after or (kinds and event.kind.value not in kinds):
            continue
        print(_line(event, proj, args.json))
    return _bad_walls("show", problems) if problems else 0


def _line(event: Event, proj: Projection, as_json: bool) -> str:
    """One output line: the event's JSON (``--json``), else its timeline row."""
    return event.to_json() if as_json else timeline_line(event, proj.state.value)


def _await_log(args: argparse.Namespace) -> Path:
    """The log ``follow`` was given, waited for while it is not there yet (its engine has not started) until ``--timeout``."""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    waiting = False
    while True:
        try:
            return log_file(args.path, hint=_PICK_ONE)
        except FileNotFoundError as exc:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                msg = f"{exc} after waiting {args.timeout:g} s (--timeout)"
                raise NoEventLog(msg) from None
            if not waiting:
                print(f"torpor log: {exc} yet; waiting for it (Ctrl-C to stop)", file=sys.stderr, flush=True)
                waiting = True
            time.sleep(args.interval if left is None else min(args.interval, left))


def run_follow(args: argparse.Namespace) -> int:
    """Print old events, then new ones as they arrive, until Ctrl-C or ``--timeout``."""
    path = _await_log(args)  # an empty log is followed: its first event is yet to come
    events = list(read_events(path))
    after = args.after
    if after is None:
        tail = events[-args.lines :] if args.lines > 0 else []
        after = tail[0].seq - 1 if tail else (events[-1].seq if events else 0)
    proj = Projection()
    if not args.json:
        _header(path, print)
    problems = [p for p in map(wall_problem, events) if p is not None]
    for event in events:
        proj.apply(event)
        if event.seq > after:
            print(_line(event, proj, args.json))
    after = max(after, events[-1].seq if events else 0)
    if problems:
        _bad_walls("follow", problems)
    sys.stdout.flush()
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    with Follower(path, after=after) as follower:
        while True:
            new = follower.read_available()
            for event in new:
                proj.apply(event)
                print(_line(event, proj, args.json), flush=True)
                problem = wall_problem(event)
                if problem is not None:
                    problems.append(problem)
                    _bad_walls("follow", [problem])
            if new and args.timeout is not None:
                deadline = time.monotonic() + args.timeout
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not new:
                time.sleep(args.interval)
    return 1 if problems else 0


def _date(wall: float) -> str:
    """``YYYY-MM-DD HH:MM:SS``, ``-`` for none, ``time out of range`` for a wall that is no date."""
    if not wall:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))
    except (OverflowError, OSError, ValueError):
        return f"time out of range: {wall!r}"


def _state_line(proj: Projection) -> str:
    """The state, as every reader names it (``closed`` after a clean close), and since when."""
    since = f"since event #{proj.since} ({_date(proj.since_wall)})" + (f", level {proj.level}" if proj.level else "")
    if proj.closed:
        return f"closed at event #{proj.last_seq} (the engine closed its log), {proj.state.value} {since}"
    return f"{proj.state.value} {since}"


def recovery_recipe(path: Path, proj: Projection) -> str:
    """The line that reopens ``path`` as the engine and rank that wrote it and recovers it (without them it wrote as 'default')."""
    engine = f", engine={proj.engine!r}" if proj.engine else ""
    return f"SleepController(memory, log={str(path)!r}{engine}, rank={proj.rank}).recover()"


def replay_text(path: Path, proj: Projection, running: bool | None = None) -> str:
    """The human report of a replayed log; ``running``: whether its writer still runs (None: not known)."""
    lines = [
        f"event log   {path}",
        f"engine      {proj.engine or '-'} rank {proj.rank} (pid {proj.pid})",
        f"events      {proj.last_seq} (last: #{proj.last_seq} {proj.last_kind or '-'}; last step: {proj.last_step or '-'})",
        f"state       {_state_line(proj)}",
        f"transitions {proj.transitions}, refusals {proj.refusals}, pinned host backup {byte_size(proj.pinned_bytes)}",
        f"graph pool  {proj.pool or 'none'}"
        + (f", {proj.graph_count} graph(s): {', '.join(proj.graphs)}" if proj.graphs else "")
        + (f" (the last {len(proj.graphs)} shown)" if proj.graph_count > len(proj.graphs) else ""),
        "",
    ]
    rows = []
    for tag, u in sorted(proj.residency.items()):
        where = "asleep" if tag in proj.asleep_tags() else "awake"
        rows.append([tag, where, byte_size(u.resident), byte_size(u.host), byte_size(u.discarded)])
    if rows:
        lines.append(table(["tag", "now", "resident", "on host", "discarded"], rows, indent=""))
    else:
        lines.append("no tagged memory recorded")
    if proj.interrupted and running:
        lines += [
            "",
            f"IN FLIGHT: the log ends inside a transition ({proj.state.value}), at {proj.last_step};",
            f"  its writer (pid {proj.pid}) still runs: a command under way (replay again to see it end), or one",
            "  interrupted inside that process, which then needs controller.recover().",
        ]
    elif proj.interrupted:
        gone = f"its writer (pid {proj.pid}) is gone" if running is False else "its writer is not known to run"
        lines += [
            "",
            f"INTERRUPTED: the log ends inside a transition ({proj.state.value}), at {proj.last_step}; {gone}.",
            "  The process stopped mid-step: memory of the tags above may be partly released.",
            "  Recovery: restart the engine with this log and call controller.recover(), e.g.",
            f"    {recovery_recipe(path, proj)}",
            "  which records a 'recovered' event and starts clean (awake) from the memory's actual usage.",
        ]
    return "\n".join(lines)


def run_replay(args: argparse.Namespace) -> int:
    """Print the projection of the log."""
    path = log_file(args.path, hint=_PICK_ONE)
    events = list(read_events(path))
    if not events:
        raise no_events(path)
    proj = project(events)
    running = writer_running(proj.pid) if proj.interrupted else None
    if args.json:
        import json

        print(json.dumps(proj.to_dict(), indent=2, sort_keys=True))
    else:
        print(replay_text(path, proj, running))
    problems = [p for p in map(wall_problem, events) if p is not None]
    if problems:
        return _bad_walls("replay", problems)
    return EXIT_INTERRUPTED if proj.interrupted and not running else 0
