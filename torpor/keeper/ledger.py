"""The keeper's records and how they change as engines come and go: regions, backups, engines, adoptions, the budget.

Every method runs under the keeper's one lock (:class:`~torpor.keeper.daemon.Keeper`
holds it around each operation and each connection's end); none blocks on a
peer. :meth:`Ledger.collect` closes each region that no live engine uses and no
backup needs.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from typing import Any

from torpor.keeper.holdings import Backup, Engine, Region, Session

__all__ = ["Ledger"]

logger = logging.getLogger("torpor.keeper")


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
                engine.alive = False
                engine.ended = time.time()
                for r in self.regions.values():
                    if r.pid == engine.pid:
                        r.in_use = False
                kept = self.backups.get(engine.name)
                if kept is not None:
                    logger.info("engine %r (pid %d) ended; its backup %s is kept", name, engine.pid, kept.id)
        self.collect()

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
