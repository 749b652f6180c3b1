"""The keeper's records and how they change as engines come and go: regions, backups, engines, adoptions, the budget.

Every method runs under the keeper's one lock (:class:`~torpor.keeper.daemon.Keeper`
holds it around each operation and each connection's end); none blocks on a
peer. :meth:`Ledger.collect` closes each region that no live engine uses and no
backup needs.

An engine dies with its process's last connection; the keeper learns that when
it reads the connection's end, on that connection's thread, which may come after
a new process's ``claim``, ``adopt``, ``hello`` or an operator's ``drop`` (the
writer was killed a moment before), or never, while another process (a child
it forked) holds its socket open. So before any of those is refused because the
writer is alive, :meth:`Ledger.alive` asks the kernel: a process that has exited
(a zombie too) or whose pid now names a process that started at another time
(:func:`gone`; the start time is taken at connect, :func:`process_start`) ends
its engine there, as its connection's end would. No descriptor is held per
engine for this (a pidfd would be one more to run out of).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

from torpor.keeper.holdings import Backup, Engine, Region, Session

__all__ = ["Ledger", "gone", "process_start"]

logger = logging.getLogger("torpor.keeper")


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat``); None once it has exited (a zombie too).

    Other errors reading it (OSError) are raised.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the name, in parentheses, may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):  # state: exited, not (yet) reaped
        return None
    return int(fields[19])  # field 22 of stat(5), the 20th after the state


def gone(pid: int, started: int | None) -> bool:
    """Whether process ``pid``, which started at ``started`` (None: not known), has exited or its pid names another.

    What cannot be read is taken as alive (the keeper refuses as it would have).
    """
    try:
        now = process_start(pid)
    except (OSError, ValueError, IndexError):
        return False
    return now is None or (started is not None and now != started)


class Ledger:
    """What a keeper of ``budget`` bytes holds; ``socket`` and ``uid`` are reported by :meth:`status`."""

    def __init__(self, budget: int, socket: str, uid: int) -> None:
        self.budget = budget
        self.socket = socket
        self.uid = uid
        self.regions: dict[int, Region] = {}
        self.backups: dict[str, Backup] = {}  # by engine
        self.engines: dict[str, Engine] = {}
        self.adoptions: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self.started = time.time()

    def next_id(self) -> int:
        """A number no region or backup of this keeper had."""
        return next(self._ids)

    def used(self) -> int:
        """Bytes in regions now."""
        return sum(r.nbytes for r in self.regions.values())

    def collect(self) -> None:
        """Close every region no live engine uses and no backup needs."""
        needed = {r for b in self.backups.values() for r in b.regions}
        for rid in [r.id for r in self.regions.values() if not r.in_use and r.id not in needed]:
            os.close(self.regions.pop(rid).fd)

    def let_go(self, backup: Backup, session: Session) -> None:
        """Connection ``session`` holds ``backup`` no more; with no connection holding it, anyone may adopt it."""
        backup.holders.discard(session.id)
        if not backup.holders:
            backup.adopter = None

    def ended(self, session: Session) -> None:
        """A connection closed: every backup it held is let go; its engine dies with the last connection of it."""
        for b in self.backups.values():
            if b.id in session.grants:
                self.let_go(b, session)  # an adopter that ended before it said adopted: the backup stays
        session.grants.clear()
        name = session.engine
        engine = self.engines.get(name) if name is not None else None
        if engine is not None and engine.pid == session.pid and engine.alive:
            engine.connections -= 1
            if engine.connections <= 0:
                self._end(engine, "ended")
        self.collect()

    def alive(self, engine: Engine) -> bool:
        """Whether ``engine``'s process lives; one found gone (:func:`gone`) ends it here, as its last connection's end would."""
        if engine.alive and gone(engine.pid, engine.started):
            self._end(engine, "exited before the keeper read its connection's end")
            self.collect()
        return engine.alive

    def _end(self, engine: Engine, how: str) -> None:
        """``engine``'s process is gone: its regions are used no more (a backup keeps those it needs)."""
        engine.alive = False
        engine.ended = time.time()
        for r in self.regions.values():
            if r.pid == engine.pid:
                r.in_use = False
        kept = self.backups.get(engine.name)
        if kept is not None:
            logger.info("engine %r (pid %d) %s; its backup %s is kept", engine.name, engine.pid, how, kept.id)

    def close(self) -> None:
        """Close every region (the backups are lost)."""
        for r in self.regions.values():
            os.close(r.fd)
        self.regions.clear()
        self.backups.clear()

    def status(self) -> dict[str, Any]:
        """The keeper's state as data: budget, bytes held, engines, backups (tags, bytes, age, model), adoptions."""
        now = time.time()
        engines = [
            {"engine": e.name, "pid": e.pid, "alive": e.alive, "since": e.since, "ended": e.ended}
            for e in self.engines.values()
        ]
        backups = []
        for b in self.backups.values():  # the digest and summary were computed at publish, outside the lock
            backups.append(
                {"backup": b.id, "engine": b.engine, "pid": b.pid, "tags": b.tags, "bytes": b.nbytes}
                | {"tensors": len(b.tensors), "age_s": now - b.published, "model": b.summary}
                | {"source": b.identity.source, "digest": b.digest, "adopter": b.adopter}
            )
        return {"keeper_pid": os.getpid(), "socket": self.socket, "uid": self.uid, "budget": self.budget} | {
            "used": self.used(),
            "regions": len(self.regions),
            "uptime_s": now - self.started,
            "engines": engines,
            "backups": backups,
            "adoptions": list(self.adoptions),
        }
