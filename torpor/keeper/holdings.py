"""What the keeper holds, as records: its regions, the backups published, the engines it has heard from, its connections."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

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
    """A published backup: the engine, the pid that wrote it, the identity, the manifest and the regions it needs."""

    id: str
    engine: str
    pid: int
    identity: dict[str, Any]
    tags: list[str]
    nbytes: int
    tensors: dict[str, Any]
    regions: set[int]
    published: float = field(default_factory=time.time)
    adopter: int | None = None  # pid of the process adopting it now


@dataclass
class Engine:
    """An engine the keeper has heard from: its name, its process and since when, whether it is alive."""

    name: str
    pid: int
    since: float = field(default_factory=time.time)
    alive: bool = True
    ended: float | None = None


@dataclass
class Session:
    """One connection: the peer's pid (``SO_PEERCRED``), the engine it speaks for, the backup it was granted."""

    pid: int
    engine: str | None = None
    grant: str | None = None  # the id of the backup this connection claimed or adopts
    verified: bool = False  # the grant's identity was checked (adopt), not only claimed
