"""A connection to a keeper: one request and its reply at a time, refusals raised as the keeper's errors."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torpor.keeper import wire
from torpor.keeper.refusals import (
    AdoptionRefused,
    KeeperBudgetExceeded,
    KeeperDenied,
    KeeperError,
    KeeperUnavailable,
)

__all__ = ["KeeperLink"]


class KeeperLink:
    """A connection to the keeper at ``path`` (:func:`~torpor.keeper.wire.socket_path` when None).

    Raises :class:`KeeperUnavailable` when nothing answers and
    :class:`KeeperDenied` when the socket's directory or the keeper refuses
    this user. Each call takes ``timeout`` seconds at most.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, timeout: float = 30.0) -> None:
        self.path: Path = wire.socket_path(path)
        self._lock = threading.Lock()
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
