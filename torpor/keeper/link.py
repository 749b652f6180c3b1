"""A connection to a keeper: one request and its reply at a time, refusals raised as the keeper's errors.

Before it sends anything, a :class:`KeeperLink` checks that the keeper is this
user's (docs/keeper.md, "Threat model"): the socket's directory is a directory
(not a symlink) owned by this process's uid that no group or other user may
write, the socket is a socket owned by this uid, and the process listening
there runs as this uid (``SO_PEERCRED``, which the kernel recorded when it
listened and which the path checks cannot be raced past). Anything else is
:class:`KeeperUntrusted`, naming the path, the owner found and the owner
expected: an engine never maps another user's memory under its backups, and
an adopter never loads bytes another user served.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torpor.errors import (
    AdoptionRefused,
    KeeperBudgetExceeded,
    KeeperDenied,
    KeeperError,
    KeeperUnavailable,
    KeeperUntrusted,
)
from torpor.keeper import wire

__all__ = ["KeeperLink"]


class KeeperLink:
    """A connection to the keeper at ``path`` (:func:`~torpor.keeper.wire.socket_path` when None).

    Raises :class:`KeeperUnavailable` when nothing answers,
    :class:`KeeperUntrusted` when the directory, the socket or the process
    listening there is not this user's (checked before anything is sent), and
    :class:`KeeperDenied` when the keeper refuses this user. Each call takes
    ``timeout`` seconds at most.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, timeout: float = 30.0) -> None:
        self.path: Path = wire.socket_path(path)
        self._lock = threading.Lock()
        _check_path(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(self.path))
        except PermissionError as exc:
            self._sock.close()
            owner = _owner(self.path)
            raise KeeperDenied(str(self.path), os.getuid(), owner, f"the socket refused it ({exc.strerror})") from exc
        except OSError as exc:
            self._sock.close()
            raise KeeperUnavailable(str(self.path), exc.strerror or str(exc)) from exc
        try:
            _check_peer(self._sock, self.path)
        except BaseException:
            self._sock.close()
            raise
        self.closed = False

    def call(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """Send ``op`` with ``fields``; the reply and its descriptors (the caller closes them); refusals raised."""
        with self._lock:
            if self.closed:
                raise KeeperUnavailable(str(self.path), "this connection was closed")
            try:
                wire.send(self._sock, {"op": op, **fields})
                reply, fds = wire.receive(self._sock)
            except (OSError, ValueError) as exc:
                self._close_locked()
                raise KeeperUnavailable(str(self.path), f"the keeper stopped answering: {exc}") from exc
        error = reply.get("error")
        if error is None:
            return reply, fds
        for fd in fds:
            os.close(fd)
        raise _refusal(str(self.path), error, reply)

    # -- the operations ------------------------------------------------------------------

    def hello(self, engine: str) -> dict[str, Any]:
        """Name this process's engine (one live process per name)."""
        return self.call("hello", engine=engine)[0]

    def create(self, nbytes: int) -> tuple[int, int]:
        """A new region of ``nbytes``: (its id, a descriptor the caller closes); over budget raises :class:`KeeperBudgetExceeded`."""
        reply, fds = self.call("create", nbytes=nbytes)
        return int(reply["region"]), _one(fds, str(self.path))

    def free(self, region: int) -> None:
        """This engine uses ``region`` no more (the keeper closes it once no backup needs it)."""
        self.call("free", region=region)

    def publish(self, manifest: Mapping[str, Any]) -> str:
        """Publish this engine's backup (identity, tags, bytes, tensors -> segments); its id."""
        return str(self.call("publish", **manifest)[0]["backup"])

    def retract(self) -> None:
        """This engine's published backup is stale (it woke)."""
        self.call("retract")

    def status(self) -> dict[str, Any]:
        """The keeper's state (:meth:`~torpor.keeper.daemon.Keeper.status`)."""
        return self.call("status")[0]

    def adopt(self, engine: str, identity: Mapping[str, Any]) -> dict[str, Any]:
        """Ask for a dead process's backup of ``engine``; its manifest, or :class:`AdoptionRefused` with the reason."""
        try:
            return self.call("adopt", engine=engine, identity=dict(identity))[0]
        except AdoptionRefused as exc:
            raise AdoptionRefused(engine, exc.reason) from None

    def claim(self, engine: str) -> dict[str, Any]:
        """Hold a dead process's backup of ``engine`` before the identity is known (then :meth:`adopt` checks it)."""
        try:
            return self.call("claim", engine=engine)[0]
        except AdoptionRefused as exc:
            raise AdoptionRefused(engine, exc.reason) from None

    def map(self, region: int) -> int:
        """A descriptor of ``region`` of the backup being adopted (the caller closes it)."""
        return _one(self.call("map", region=region)[1], str(self.path))

    def adopted(self, seconds: float) -> None:
        """The backup being adopted is copied: the keeper drops it."""
        self.call("adopted", seconds=seconds)

    def drop(self, engine: str) -> dict[str, Any]:
        """Drop a dead engine's backup (an operator's choice); what was dropped."""
        return self.call("drop", engine=engine)[0]

    def close(self) -> None:
        """Close the connection (an engine's regions not in a published backup go)."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self._sock.close()

    def __enter__(self) -> KeeperLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _one(fds: list[int], path: str) -> int:
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise KeeperUnavailable(path, f"the keeper sent {len(fds)} descriptors where one was due")
    return fds[0]


def _check_path(path: Path) -> None:
    """Refuse a socket whose directory or whose file is not this user's alone (:class:`KeeperUntrusted`).

    A path that does not exist is :class:`KeeperUnavailable` (no keeper); a file of this
    user's that is not a socket is one too (nothing listens there).
    """
    uid = os.getuid()
    directory = path.parent
    try:
        info = os.lstat(directory)
    except OSError as exc:
        raise KeeperUnavailable(str(path), f"its directory {directory}: {exc.strerror or exc}") from exc
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise KeeperUntrusted(str(path), f"its directory {directory} is {kind}", info.st_uid, uid)
    if info.st_uid != uid:
        raise KeeperUntrusted(str(path), f"its directory {directory} belongs to another user", info.st_uid, uid)
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("every user", stat.S_IWOTH)) if info.st_mode & bit]
    if writers:
        mode = stat.S_IMODE(info.st_mode)
        reason = f"its directory {directory} (mode {mode:04o}) may be written by {' and '.join(writers)}"
        raise KeeperUntrusted(str(path), reason, info.st_uid, uid)
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise KeeperUnavailable(str(path), exc.strerror or str(exc)) from exc
    if info.st_uid != uid:
        raise KeeperUntrusted(str(path), "the socket belongs to another user", info.st_uid, uid)
    if not stat.S_ISSOCK(info.st_mode):
        raise KeeperUnavailable(str(path), "it is not a socket (a file of this user's: no keeper listens there)")


def _check_peer(sock: socket.socket, path: Path) -> None:
    """Refuse a connection whose listening process is not of this user (``SO_PEERCRED``)."""
    pid, peer_uid, _ = wire.peer(sock)
    if peer_uid != os.getuid():
        reason = f"the process listening there (pid {pid}) runs as another user"
        raise KeeperUntrusted(str(path), reason, peer_uid, os.getuid())


def _owner(path: Path) -> int:
    for p in (path, path.parent):
        with contextlib.suppress(OSError):
            return os.stat(p).st_uid
    return -1


def _refusal(path: str, error: Any, reply: Mapping[str, Any]) -> KeeperError:
    message = str(reply.get("message", error))
    if error == "budget":
        return KeeperBudgetExceeded(int(reply["budget"]), int(reply["used"]), int(reply["asked"]))
    if error == "denied":
        return KeeperDenied(path, int(reply.get("uid", os.getuid())), int(reply.get("keeper_uid", -1)), message)
    if error == "refused":
        return AdoptionRefused(str(reply.get("engine", "?")), message)
    return KeeperError(f"the keeper at {path} refused: {message}")
