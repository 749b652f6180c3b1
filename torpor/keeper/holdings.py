"""What the keeper holds, as records: its regions, the backups published, the engines it has heard from, its connections."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torpor.keeper.fingerprint import ModelIdentity

__all__ = ["Backup", "Engine", "Region", "Session"]


@dataclass
class Region:
    """One memfd: its id, descriptor, size, the engine that asked for it, and whether that engine still uses it."""

    id: int
    fd: int
    nbytes: int
    engine: str
    pid: int
    in_use: bool = True  # its engine's process lives and has not freed it


@dataclass
class Backup:
    """A published backup: the engine, the pid that wrote it, the identity (its digest and summary computed once,
    at publish), the manifest and the regions it needs; who adopts it now."""

    id: str
    engine: str
    pid: int
    identity: ModelIdentity
    digest: str
    summary: str
    tags: list[str]
    nbytes: int
    tensors: dict[str, Any]
    regions: set[int]
    published: float = field(default_factory=time.time)
    adopter: int | None = None  # pid of the process adopting it now
    holders: set[int] = field(default_factory=set)  # the connections (Session.id) that claimed or adopt it


@dataclass
class Engine:
    """An engine the keeper has heard from: its name, its process (and when that started) and since when, whether it is alive."""

    name: str
    pid: int
    started: int | None = None  # the process's start time (clock ticks after boot) at connect; None: not known
    since: float = field(default_factory=time.time)
    alive: bool = True
    ended: float | None = None
    connections: int = 1  # of its process that said hello for it and are open: it dies with the last


@dataclass
class Session:
    """One connection: its number, the peer's pid (``SO_PEERCRED``) and its start time, its engine, the backups it holds.

    ``grants`` maps each backup this connection claimed or adopts to whether its
    identity was checked (``adopt``) or only claimed; all of them are let go
    when the connection ends.
    """

    id: int
    pid: int
    started: int | None = None  # the peer's start time at connect (:func:`torpor.keeper.ledger.process_start`)
    engine: str | None = None
    grants: dict[str, bool] = field(default_factory=dict)
