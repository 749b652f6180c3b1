"""The keeper's wire: JSON messages framed by length over a Unix stream socket, descriptors beside them (SCM_RIGHTS).

One request, one reply, in order, on each connection. A message is a 4-byte
big-endian length and that many bytes of JSON; descriptors travel in the
ancillary data of the message's first bytes (at most :data:`MAX_FDS`; each
reply here carries one at most). :func:`peer` reads the kernel's credentials of
the other end (``SO_PEERCRED``: its pid and uid when it connected, which it
cannot forge). :func:`socket_path` names the socket (:mod:`torpor.keeper.listening`
checks its directory).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torpor.keeper.refusals import WireClosed

__all__ = ["MAX_FDS", "MAX_MESSAGE", "SOCKET_ENV", "peer", "receive", "send", "socket_path"]

#: The environment variable that names the keeper's socket.
SOCKET_ENV = "TORPOR_KEEPER_SOCKET"
#: Descriptors one message may carry.
MAX_FDS = 8
#: The largest message read (a manifest of a few thousand tensors is well under 16 MiB).
MAX_MESSAGE = 64 << 20

_HEADER = struct.Struct(">I")
_CRED = struct.Struct("3i")


def socket_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The keeper's socket: ``path``, else ``$TORPOR_KEEPER_SOCKET``, else ``torpor-keeper/keeper.sock`` under
    ``$XDG_RUNTIME_DIR`` (a per-user 0700 directory) or ``torpor-keeper-<uid>/`` in the temp directory
    (the keeper makes it 0700; one another user made first is refused, never used)."""
    if path is not None:
        return Path(path)
    env = os.environ.get(SOCKET_ENV)
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "torpor-keeper" if runtime else Path(tempfile.gettempdir()) / f"torpor-keeper-{os.getuid()}"
    return base / "keeper.sock"


def peer(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel recorded them when it connected."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return pid, uid, gid


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one message (and ``fds`` beside it)."""
    body = json.dumps(message, separators=(",", ":")).encode()
    data = _HEADER.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data[:4096]], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it (close-on-exec); :class:`WireClosed` at the end."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    try:
        head += _exactly(sock, _HEADER.size - len(head), at_start=not head)
        (size,) = _HEADER.unpack(head)
        if size > MAX_MESSAGE:
            msg = f"a keeper message of {size} bytes is over the {MAX_MESSAGE}-byte limit"
            raise ValueError(msg)
        message = json.loads(_exactly(sock, size))
        if not isinstance(message, dict):
            msg = f"a keeper message is a JSON object, not {type(message).__name__}"
            raise ValueError(msg)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, list(fds)


def _exactly(sock: socket.socket, n: int, at_start: bool = False) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            where = "between messages" if at_start and not out else "inside a message"
            msg = f"the other end closed the connection {where}"
            raise WireClosed(msg)
        out += got
    return bytes(out)
