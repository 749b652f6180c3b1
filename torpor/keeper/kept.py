"""A dead engine's backup granted to this process: its regions mapped here, each tensor's bytes by name.

:func:`open_backup` asks the keeper for engine ``engine``'s backup with this
process's :class:`~torpor.keeper.fingerprint.ModelIdentity` (a mismatch is
refused with the reason), maps its regions and gives each tensor's bytes
(:meth:`KeptBackup.view`, :meth:`KeptBackup.segments`); :meth:`KeptBackup.done`
tells the keeper the copy is made (it drops the backup) and records
``backup_adopted`` on a controller. :mod:`torpor.keeper.adoption` copies one
into a PyTorch model; :mod:`torpor.keeper.prefetching` claims one before the model
exists.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torpor.errors import KeeperError
from torpor.keeper import shmem
from torpor.keeper.fingerprint import ModelIdentity
from torpor.keeper.link import KeeperLink
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.machine.controller import SleepController

__all__ = ["ADOPTED", "Adopted", "KeptBackup", "claim_backup", "open_backup"]

logger = logging.getLogger("torpor.keeper")

#: Statistics of this process's adoptions (read by :mod:`torpor.keeper.collector`).
ADOPTED = {"adoptions": 0, "bytes": 0, "fallbacks": 0}


@dataclass(frozen=True)
class Adopted:
    """One adoption: the keeper's socket, the engine, the backup's id, the dead pid, bytes, tensors and seconds."""

    keeper: str
    engine: str
    backup: str
    from_pid: int
    bytes: int
    tensors: int
    seconds: float

    def __str__(self) -> str:
        return (
            f"adopted backup {self.backup} of engine {self.engine!r} from dead pid {self.from_pid}: "
            f"{self.bytes} bytes in {self.tensors} tensors in {self.seconds:.3f} s"
        )


class KeptBackup:
    """A backup granted to this process: its regions mapped here, each tensor's bytes by name."""

    def __init__(
        self, link: KeeperLink, engine: str, reply: dict[str, Any], started: float, owns_link: bool = False
    ) -> None:
        self.link = link
        self._owns_link = owns_link
        self.engine = engine
        self.id = str(reply["backup"])
        self.from_pid = int(reply["pid"])
        self.nbytes = int(reply["bytes"])
        self._tensors: dict[str, list[list[int]]] = {n: e["segments"] for n, e in reply["tensors"].items()}
        self._started = started
        self._maps: dict[int, tuple[int, int]] = {}  # region -> (address, bytes)
        try:
            for rid, nbytes in reply["regions"].items():
                fd = link.map(int(rid))
                try:
                    self._maps[int(rid)] = (shmem.map_anywhere(fd, int(nbytes)), int(nbytes))
                finally:
                    os.close(fd)
        except BaseException:
            self.close()
            raise

    def verify(self, identity: ModelIdentity) -> None:
        """Have the keeper check a claimed backup (:func:`claim_backup`) against ``identity``; the copy's clock starts now.

        A mismatch raises :class:`~torpor.errors.AdoptionRefused` with
        the reason, and the keeper lets the claim go (another process may adopt).
        """
        reply = self.link.adopt(self.engine, identity.to_dict())
        if str(reply["backup"]) != self.id:  # the claim holds the backup: the keeper cannot grant another one
            msg = f"the keeper granted backup {reply['backup']} where this process had claimed {self.id}"
            raise KeeperError(msg)
        self._started = time.perf_counter()

    @property
    def names(self) -> list[str]:
        return list(self._tensors)

    def regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of each region mapped here (to pin them, say)."""
        return list(self._maps.values())

    def segments(self, name: str) -> Iterator[tuple[int, int, int]]:
        """(host address, bytes, offset in the tensor) of tensor ``name``'s bytes, in order."""
        at = 0
        for rid, offset, n in self._tensors[name]:
            yield self._maps[int(rid)][0] + int(offset), int(n), at
            at += int(n)

    def view(self, name: str) -> memoryview:
        """Tensor ``name``'s bytes (a copy when they lie in more than one segment)."""
        parts = list(self.segments(name))
        if len(parts) == 1:
            host, n, _ = parts[0]
            return memoryview((ctypes.c_char * n).from_address(host)).cast("B")
        return memoryview(b"".join(ctypes.string_at(h, n) for h, n, _ in parts))

    def done(self, controller: SleepController | None = None, keeper: str = "") -> Adopted:
        """The copy is made: the keeper drops the backup; ``backup_adopted`` goes to ``controller``'s log."""
        seconds = time.perf_counter() - self._started
        self.link.adopted(seconds)
        adopted = Adopted(
            keeper or str(self.link.path), self.engine, self.id, self.from_pid, self.nbytes, len(self._tensors), seconds
        )
        ADOPTED["adoptions"] += 1
        ADOPTED["bytes"] += self.nbytes
        if controller is not None:
            controller.record(EventKind.BACKUP_ADOPTED, **dataclasses.asdict(adopted))
        logger.info("%s", adopted)
        return adopted

    def close(self) -> None:
        """Unmap the regions (after the copies are done); close the connection if :func:`open_backup` made it."""
        for address, nbytes in self._maps.values():
            shmem.unmap(address, nbytes)
        self._maps.clear()
        if self._owns_link:
            self.link.close()

    def __enter__(self) -> KeptBackup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_backup(
    identity: ModelIdentity,
    *,
    keeper: str | os.PathLike[str] | None = None,
    engine: str = "default",
    link: KeeperLink | None = None,
) -> KeptBackup:
    """Engine ``engine``'s backup, checked against ``identity`` (raises :class:`AdoptionRefused` with the reason)."""
    started = time.perf_counter()
    owns = link is None
    link = link or KeeperLink(keeper)
    try:
        reply = link.adopt(engine, identity.to_dict())
    except BaseException:
        if owns:
            link.close()
        raise
    return KeptBackup(link, engine, reply, started, owns_link=owns)


def claim_backup(*, keeper: str | os.PathLike[str] | None = None, engine: str = "default") -> KeptBackup:
    """Engine ``engine``'s backup, held for this process before its model exists (mapped; :meth:`KeptBackup.verify` later).

    The keeper applies every check but the identity's (a backup is kept, its
    writer is dead, nobody else adopts it); until :meth:`KeptBackup.verify`
    passes, the keeper refuses ``adopted`` on it, and closing it lets it go.
    """
    started = time.perf_counter()
    link = KeeperLink(keeper)
    try:
        reply = link.claim(engine)
    except BaseException:
        link.close()
        raise
    return KeptBackup(link, engine, reply, started, owns_link=True)
