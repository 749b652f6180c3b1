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

import contextlib
import json
import math
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from torpor.errors import BadMessage, WireClosed
from torpor.switches import env_path

__all__ = ["MAX_FDS", "MAX_MESSAGE", "SOCKET_ENV", "peer", "receive", "send", "socket_path"]

#: The environment variable that names the keeper's socket.
SOCKET_ENV = "TORPOR_KEEPER_SOCKET"
#: Descriptors one message may carry.
MAX_FDS = 8
#: The largest message read, refused on its header before a byte of it is read (a manifest takes about
#: 160 bytes a tensor: 200 000 tensors fit).
MAX_MESSAGE = 32 << 20
#: The fewest bytes of message text per JSON array or object: parsing ``[],[],...`` costs ~25 times its size.
_BYTES_PER_CONTAINER = 8

_HEADER = struct.Struct(">I")
_CRED = struct.Struct("3i")


class _ParseBudget:
    """At most :data:`MAX_MESSAGE` bytes of messages parsed at once in this process (others wait their turn)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def held(self, nbytes: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._used == 0 or self._used + nbytes <= self._limit)
            self._used += nbytes
        try:
            yield
        finally:
            with self._cond:
                self._used -= nbytes
                self._cond.notify_all()


_PARSING = _ParseBudget(MAX_MESSAGE)


def socket_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The keeper's socket: ``path``, else ``$TORPOR_KEEPER_SOCKET``, else ``torpor-keeper/keeper.sock`` under
    ``$XDG_RUNTIME_DIR`` (a per-user 0700 directory) or ``torpor-keeper-<uid>/`` in the temp directory
    (the keeper makes it 0700; one another user made first is refused, never used)."""
    if path is not None:
        return Path(path)
    named = env_path(SOCKET_ENV)
    if named is not None:
        return named
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
    """One message and the descriptors that came with it (close-on-exec); :class:`WireClosed` at the end.

    A frame that is no message raises :class:`BadMessage`: one over :data:`MAX_MESSAGE`
    on its header, before its body is read (the stream is then out of step); a
    body that is not JSON, not an object, holds a number out of range
    (``1e400``, an integer of more than 4300 digits) or nests too densely.
    """
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS, socket.MSG_CMSG_CLOEXEC)
    try:
        head += _exactly(sock, _HEADER.size - len(head), at_start=not head)
        (size,) = _HEADER.unpack(head)
        if size > MAX_MESSAGE:
            msg = f"a keeper message of {size} bytes is over the {MAX_MESSAGE}-byte limit; none of it was read"
            raise BadMessage(msg, in_step=False)
        message = _parsed(_exactly(sock, size))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, list(fds)


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        msg = f"the number {text[:40]} is out of range"
        raise BadMessage(msg, in_step=True)
    return value


def _no_constant(text: str) -> Any:
    msg = f"{text} is not a JSON number"
    raise BadMessage(msg, in_step=True)


def _parsed(body: bytes) -> dict[str, Any]:
    containers = body.count(b"[") + body.count(b"{")
    if containers > len(body) // _BYTES_PER_CONTAINER + 16:
        msg = f"a keeper message of {len(body)} bytes holds {containers} arrays and objects, more than one per 8 bytes"
        raise BadMessage(msg, in_step=True)
    try:
        with _PARSING.held(len(body)):
            message = json.loads(body, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        msg = f"a keeper message is not valid JSON: {str(exc)[:200]}"
        raise BadMessage(msg, in_step=True) from None
    if not isinstance(message, dict):
        msg = f"a keeper message is a JSON object, not {type(message).__name__}"
        raise BadMessage(msg, in_step=True)
    return message


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
