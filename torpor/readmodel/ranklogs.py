"""The engine-wide view: per-rank event logs in one directory merged into one state per engine.

Every rank of an engine writes ``ENGINE.rankN.jsonl`` into a shared directory
(``SleepController(memory, log=DIR, engine=E, rank=N)``). :func:`fleet` replays
each file and merges the ranks: all asleep is ``asleep``, all awake ``awake``,
all partially awake ``partially_awake``; anything else is ``transitional``:
the rank whose state changed last leads, and the ranks not in its state are
named as lagging. A rank without a log (a gap in the rank
numbers, or below ``world_size``) lags too; a rank whose log cannot be read
makes the engine ``unknown``.

Ranks that run their commands as a group (``SleepController(..., group=pg)``)
record each group outcome; :attr:`EngineView.group` compares the last one of
every rank: consistent when every rank is in the same state after the same
group command with the same result, else split, naming the ranks that differ.

This module reads the logs; the views and the merge rules are in
:mod:`torpor.readmodel.fleetview` (re-exported here).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from torpor.errors import (
    FleetError,
    TorporError,
)
from torpor.readmodel.fleetview import ENGINE_STATES, EngineView, FleetView, GroupView, RankView, group_view, merge
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.follow import Follower
from torpor.statemachine.log.reader import DEFAULT_MAX_LINE, decode_line
from torpor.statemachine.projection.view import Projection, project

__all__ = [
    "ENGINE_STATES",
    "MAX_WORLD_SIZE",
    "EngineView",
    "FleetError",
    "FleetView",
    "GroupView",
    "RankView",
    "check_world_size",
    "fleet",
    "group_view",
    "merge",
    "project_rank",
    "rank_follower",
    "rank_logs",
    "wait_fleet",
    "wait_fleet_async",
]

#: The most ranks one engine is taken to have (``world_size``): far above any tensor/pipeline/expert-parallel
#: engine, and a view of that many ranks is still built and printed in well under a second.
MAX_WORLD_SIZE = 4096


def check_world_size(world_size: object) -> None:
    """Refuse a ``world_size`` that is no int in 1..:data:`MAX_WORLD_SIZE` (``0`` and ``-5`` were taken; 20000 took 7 s)."""
    if world_size is None:
        return
    if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
        msg = (
            f"world_size={world_size!r} is refused: the number of ranks the engine has, an int from 1 to "
            f"{MAX_WORLD_SIZE} (or None: as many as the logs in the directory)"
        )
        raise FleetError(msg)


_LOG_NAME = re.compile(r"^(?P<engine>.+)\.rank(?P<rank>\d+)\.jsonl(?:\.\d+)?$")


def rank_logs(directory: str | os.PathLike[str]) -> dict[str, dict[int, Path]]:
    """``{engine: {rank: path of the active log}}`` for the per-rank logs in ``directory``.

    A rank with only rotated segments (a crash between a rotation's rename and
    its new file) is listed with the active path, which reads its segments.
    """
    root = Path(directory)
    if not root.exists():
        msg = f"no such directory: {root}"
        raise FleetError(msg)
    if not root.is_dir():
        msg = f"not a directory: {root} (give the directory the ranks log into)"
        raise FleetError(msg)
    found: dict[str, dict[int, Path]] = {}
    for entry in sorted(root.iterdir()):
        match = _LOG_NAME.match(entry.name)
        if match and entry.is_file():
            active = root / f"{match['engine']}.rank{match['rank']}.jsonl"
            found.setdefault(match["engine"], {})[int(match["rank"])] = active
    return found


def _first_event(path: Path) -> Event | None:
    """The first event of the active file, None when it is missing, empty or its first line is unfinished."""
    try:
        with open(path, "rb") as fh:
            line = fh.readline(DEFAULT_MAX_LINE + 1)
    except FileNotFoundError:
        return None
    if not line.endswith(b"\n"):
        return None
    return decode_line(line[:-1], str(path), 1)


def rank_follower(path: Path) -> Follower:
    """A follower of one rank's log from the snapshot that opens its active file (from its start without one)."""
    first = _first_event(path)
    after = first.seq - 1 if first is not None and first.kind is EventKind.SNAPSHOT else 0
    return Follower(path, after=after)


def project_rank(path: Path) -> Projection:
    """The projection of one rank's log, read the way :class:`~torpor.hooks.Follower` reads it.

    When the active file opens with a rotation snapshot only that file is read
    (the snapshot carries the whole projection), so a status query costs the
    same however long the history. A line being written is not an error, and
    pruned segments are skipped with a warning; a corrupted line raises,
    wherever it is: the events before it are not a state of the rank (they
    would show a sleep as still suspending), so the rank is unreadable, as
    ``torpor log show`` and ``replay`` say.
    """
    with rank_follower(path) as follower:
        return project(follower.events())  # not read_available(): it hands out the events before a bad line


def _rank_view(engine: str, rank: int, path: Path, read: Callable[[Path], Projection]) -> RankView:
    try:
        proj = read(path)
    except (TorporError, OSError, ValueError) as exc:
        return RankView(engine, rank, path, "unreadable", error=str(exc))
    if proj.last_seq == 0:
        return RankView(engine, rank, path, "unreadable", error="the log holds no complete event yet")
    closed = proj.last_kind == "closed"
    return RankView(
        engine=engine,
        rank=rank,
        path=path,
        state="closed" if closed else proj.state.value,
        since=proj.last_seq if closed else proj.since,  # closed: since its closed event, not the state before
        since_wall=proj.last_wall if closed else proj.since_wall,
        last_seq=proj.last_seq,
        pid=proj.pid,
        level=proj.level,
        residency=dict(proj.residency),
        group=proj.group,
        pinned_bytes=proj.pinned_bytes,
        host_policy=dict(proj.host_policy),
        device_asleep=dict(proj.device_asleep),
    )


def fleet(
    directory: str | os.PathLike[str],
    *,
    engine: str | None = None,
    world_size: int | None = None,
    read: Callable[[Path], Projection] = project_rank,
) -> FleetView:
    """The engine-wide view of every engine logging into ``directory`` (or only ``engine``).

    Ranks missing from the numbering (below the highest rank seen, or below
    ``world_size`` when given) count as lagging with no log. Raises
    :class:`FleetError` for a directory that holds no per-rank logs. ``read``
    gives a rank log's projection (:func:`project_rank`, or a reader that keeps
    a tail per rank and reads only what was appended, as the vLLM route does).
    """
    check_world_size(world_size)
    root = Path(directory)
    logs = rank_logs(root)
    if engine is not None:
        if engine not in logs:
            known = ", ".join(sorted(logs)) or "none"
            msg = f"no logs of engine {engine!r} in {root} (engines there: {known})"
            raise FleetError(msg)
        logs = {engine: logs[engine]}
    if not logs:
        msg = f"no per-rank event logs (ENGINE.rankN.jsonl) in {root}"
        raise FleetError(msg)
    views = []
    for name, files in sorted(logs.items()):
        size = max(max(files) + 1, world_size or 0)
        ranks = [
            _rank_view(name, rank, files[rank], read) if rank in files else RankView(name, rank, None, "no log")
            for rank in range(size)
        ]
        views.append(merge(name, ranks))
    return FleetView(root, tuple(views))


def _fleet_once_logged(
    directory: str | os.PathLike[str], engine: str | None, world_size: int | None
) -> FleetView | None:
    """:func:`fleet`, or None while no log (of ``engine``) is there yet; a path that is no directory is refused."""
    root = Path(directory)
    if not root.exists():
        return None
    logs = rank_logs(root)
    if not logs or (engine is not None and engine not in logs):
        return None
    return fleet(root, engine=engine, world_size=world_size)


def wait_fleet(
    directory: str | os.PathLike[str],
    state: str,
    timeout: float | None = None,
    *,
    engine: str | None = None,
    world_size: int | None = None,
    poll: float = 0.2,
) -> FleetView | None:
    """Poll until every engine (or ``engine``) in ``directory`` is in ``state``; the view, or None on timeout.

    A directory with no logs yet (or none of ``engine``, or no directory yet) is
    an engine that has not started: it is waited for, as a state is.
    """
    check_world_size(world_size)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        view = _fleet_once_logged(directory, engine, world_size)
        if view is not None and view.engines and all(e.matches(state) for e in view.engines):
            return view
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(poll if deadline is None else max(0.0, min(poll, deadline - time.monotonic())))


async def wait_fleet_async(
    directory: str | os.PathLike[str],
    state: str,
    timeout: float | None = None,
    *,
    engine: str | None = None,
    world_size: int | None = None,
    poll: float = 0.2,
) -> FleetView | None:
    """Asyncio variant of :func:`wait_fleet` (an engine not logging yet waited for); the logs are read in a worker thread."""
    check_world_size(world_size)
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    while True:
        view = await asyncio.to_thread(_fleet_once_logged, directory, engine, world_size)
        if view is not None and view.engines and all(e.matches(state) for e in view.engines):
            return view
        if deadline is not None and loop.time() >= deadline:
            return None
        await asyncio.sleep(poll if deadline is None else max(0.0, min(poll, deadline - loop.time())))
