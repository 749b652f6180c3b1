"""The keeper's wire: JSON messages framed by length over a Unix stream socket, descriptors beside them (SCM_RIGHTS).

One request, one reply, in order, on each connection. A message is a 4-byte
big-endian length and that many bytes of JSON; descriptors travel in the
ancillary data of the message's first bytes (at most :data:`MAX_FDS`; each
reply here carries one at most). :func:`peer` reads the kernel's credentials of
the other end (``SO_PEERCRED``: its pid and uid when it connected, which it
cannot forge). :func:`socket_path` and :func:`private_dir` place the socket in a
directory only its user may enter.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torpor.keeper.refusals import WireClosed

__all__ = ["MAX_FDS", "MAX_MESSAGE", "SOCKET_ENV", "peer", "private_dir", "receive", "send", "socket_path"]

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
    (made 0700; one another user made first is refused, never used)."""
    if path is not None:
        return Path(path)
    env = os.environ.get(SOCKET_ENV)
    if env:
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "torpor-keeper" if runtime else Path(tempfile.gettempdir()) / f"torpor-keeper-{os.getuid()}"
    return base / "keeper.sock"


def private_dir(path: Path) -> Path:
    """Make ``path`` (the socket's directory) exist, owned by this user and mode 0700; refuse one that is not."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        msg = f"{path} is not a directory (a symlink or a file): the keeper's socket needs a private directory"
        raise PermissionError(msg)
    if info.st_uid != os.getuid():
        msg = f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); the keeper will not use it"
        raise PermissionError(msg)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours: make it private (another user may have been able to enter it)
    return path


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
