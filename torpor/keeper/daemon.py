"""The keeper process: memfd regions it owns, handed to engines of its own user, kept when an engine dies asleep.

An engine says ``hello`` (its name), asks for regions (``create``: a memfd
within the byte budget, its descriptor sent back) that its allocator maps
under its host backups, and after each sleep ``publish``es a manifest: the
model's identity and, per tensor, where its bytes are (region, offset,
bytes). A wake ``retract``s it (the device holds the newest bytes again). When
the engine's connection closes (it exited or was killed), the regions its
published backup needs stay; the others go. A new process of the same engine
``adopt``s: the keeper checks the identity (:func:`~torpor.keeper.fingerprint.mismatch`),
answers with the manifest, hands each region on ``map``, and drops the backup
once told ``adopted``. A ``claim`` holds a backup before the adopter's model
exists (every check but the identity's); its ``adopt`` checks the identity
(a mismatch lets the claim go), and ``adopted`` waits for that check.

Access: the socket lives in a directory only its user may write (one the
keeper makes is 0700; :mod:`torpor.keeper.listening`) and is mode 0600; every
connection's peer uid (``SO_PEERCRED``) must be the keeper's own, or it gets
one refusal and is closed. Regions are never written or read here; a
descriptor goes only to the engine that asked for it, or to the adopter of
the backup that holds it. One thread per connection; one lock over the
records (no call under it blocks on a peer).

This module is the process: the socket's life and each connection's loop.
The operations are :data:`torpor.keeper.operations.OPS` (one function per
``op``) over the records of :class:`torpor.keeper.ledger.Ledger`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from torpor.errors import BadArgument, BadMessage, RequestRefused
from torpor.keeper import wire
from torpor.keeper.holdings import Session
from torpor.keeper.ledger import Ledger, process_start
from torpor.keeper.listening import Listening, Reserve
from torpor.keeper.operations import OPS, Reply
from torpor.units import byte_size

__all__ = ["MAX_CONNECTIONS", "Keeper"]

logger = logging.getLogger("torpor.keeper")

#: Connections served at once (each has a thread); one more is answered with a refusal and closed.
MAX_CONNECTIONS = 256
_SHORT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_TRANSIENT = {errno.ECONNABORTED, errno.EINTR, errno.EPROTO}


class Keeper:
    """A keeper serving ``path`` with at most ``budget_bytes`` in regions; :meth:`serve` blocks, :meth:`start` runs it in a thread."""

    def __init__(self, path: str | os.PathLike[str] | None = None, budget_bytes: int = 64 << 30) -> None:
        if budget_bytes <= 0:
            msg = f"the keeper's budget must be a positive number of bytes, not {budget_bytes}"
            raise BadArgument(msg)
        self.path = wire.socket_path(path)
        self.budget = budget_bytes
        self.uid = os.getuid()
        self._lock = threading.Lock()
        self._ledger = Ledger(budget_bytes, str(self.path), self.uid)
        self._listening: Listening | None = None
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._sessions = itertools.count(1)
        self._connections = 0
        self._reserve = Reserve()  # a descriptor held back to answer a connection when every other one is taken
        self._warned = 0.0
        self.started = self._ledger.started
        _more_descriptors()

    # -- running ---------------------------------------------------------------------

    def bind(self) -> None:
        """Take the socket's path (:class:`~torpor.keeper.listening.Listening`) and listen; :class:`KeeperPathRefused` says why not."""
        self._listening = Listening(self.path)
        self._listener = self._listening.socket
        self._reserve.hold()

    def serve(self) -> None:
        """Accept connections until :meth:`close` (binds first if needed); running out of descriptors ends nothing."""
        if self._listener is None:
            self.bind()
        listener = self._listener
        if listener is None:  # bind sets it
            return
        logger.info("keeper %d serving %s with a budget of %s", os.getpid(), self.path, byte_size(self.budget))
        while not self._closing:
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._closing:
                    return
                if exc.errno in _SHORT_OF_RESOURCES:
                    self._shed(listener, exc)
                elif exc.errno not in _TRANSIENT:
                    raise
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn`` on a thread of its own, or refuse it when :data:`MAX_CONNECTIONS` are served."""
        with self._lock:
            full = self._connections >= MAX_CONNECTIONS
            self._connections += 0 if full else 1
        if full:
            message = f"the keeper serves at most {MAX_CONNECTIONS} connections at once"
            self._spawn(functools.partial(_refuse, conn, message, socket.socket.close), conn.close)
        else:
            self._spawn(functools.partial(self._serve_one, conn), functools.partial(self._unserved, conn))

    def _unserved(self, conn: socket.socket) -> None:
        conn.close()
        with self._lock:
            self._connections -= 1

    @staticmethod
    def _spawn(work: Callable[[], None], undo: Callable[[], None]) -> None:
        """Run ``work`` on a thread of its own; with no thread to be had, ``undo`` (the connection goes, the keeper stays)."""
        try:
            threading.Thread(target=work, name="torpor-keeper-conn", daemon=True).start()
        except RuntimeError:
            undo()

    def _shed(self, listener: socket.socket, exc: OSError) -> None:
        """Out of descriptors: accept on the reserve's slot; serve the connection if a reserve can be had again, else refuse it."""
        now = time.monotonic()
        if now - self._warned > 10:
            self._warned = now
            logger.warning("the keeper is out of descriptors (%s): connections are refused; backups are kept", exc)
        if not self._reserve.release():  # no reserve, none to be had: no event says when one is freed
            time.sleep(0.05)
            return
        try:
            conn, _ = listener.accept()
        except OSError:  # the keeper stops, or the number went to another descriptor first
            self._reserve.hold()
            return
        if self._reserve.hold():  # descriptors are to be had again: served as any other
            self._admit(conn)
            return
        message = (
            f"the keeper is out of file descriptors ({exc.strerror or exc}); it serves again once some are freed, "
            "and every backup it holds is kept"
        )
        self._reserve.lend()
        park = self._reserve.park
        self._spawn(functools.partial(_refuse, conn, message, park), functools.partial(park, conn))

    def start(self) -> Keeper:
        """Bind and serve in a daemon thread (tests, an engine that hosts its own keeper); returns self."""
        self.bind()
        self._thread = threading.Thread(target=self.serve, name="torpor-keeper", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, close every region (backups are lost) and remove the socket if it is still this keeper's."""
        self._closing = True
        if self._listening is not None:
            self._listening.close()  # the socket and its lock file go only if they are still this keeper's
        with self._lock:
            self._ledger.close()
        self._reserve.close()

    # -- one connection ---------------------------------------------------------------

    def _serve_one(self, conn: socket.socket) -> None:
        session = Session(id=next(self._sessions), pid=-1)
        try:
            pid, uid, _ = wire.peer(conn)
            session.pid = pid
            with contextlib.suppress(OSError, ValueError, IndexError):
                session.started = process_start(pid)
            if uid != self.uid:
                logger.warning("refused pid %d of uid %d (this keeper serves uid %d only)", pid, uid, self.uid)
                reason = "SO_PEERCRED says another user"
                wire.send(conn, {"error": "denied", "message": reason, "uid": uid, "keeper_uid": self.uid})
                return
            while True:
                try:
                    request, fds = wire.receive(conn)
                except BadMessage as bad:
                    wire.send(conn, {"error": "usage", "message": bad.reason})
                    if bad.in_step:
                        continue
                    return
                for fd in fds:  # nobody hands the keeper descriptors
                    os.close(fd)
                reply, out = self._handle(session, request)
                try:
                    wire.send(conn, reply, out)
                finally:
                    for fd in out:
                        os.close(fd)
        except OSError as exc:  # the peer went (WireClosed, a reset) or the kernel refused a send
            if not isinstance(exc, ConnectionError):
                logger.info("a connection of pid %d ended: %s", session.pid, exc)
        except Exception:
            logger.exception("a keeper connection failed")
        finally:
            conn.close()
            with self._lock:
                self._connections -= 1
                self._ledger.ended(session)

    def _handle(self, session: Session, request: dict[str, Any]) -> Reply:
        op = request.get("op")
        operation = OPS.get(op) if isinstance(op, str) else None
        if operation is None:
            valid = ", ".join(sorted(OPS))
            shown = repr(op)[:80]
            return {"error": "usage", "message": f"no keeper operation {shown} (the operations: {valid})"}, []
        try:
            parsed = operation.parse(request)  # the costly checks, outside the lock
            with self._lock:
                return operation.apply(self._ledger, session, parsed)
        except RequestRefused as refusal:
            return refusal.reply, []
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            return {"error": "usage", "message": f"a malformed {op!r} request: {exc!r}"[:300]}, []

    def status(self) -> dict[str, Any]:
        """The keeper's state as data: budget, bytes held, engines, backups (tags, bytes, age, model), adoptions."""
        with self._lock:
            return self._ledger.status()


def _refuse(conn: socket.socket, message: str, then: Callable[[socket.socket], None]) -> None:
    """Read the connection's first request (2 s at most), answer it with refusal ``message``; then ``then(conn)`` (its end)."""
    try:
        conn.settimeout(2.0)
        with contextlib.suppress(OSError, BadMessage):
            _, fds = wire.receive(conn)
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(OSError):
            wire.send(conn, {"error": "resources", "message": message})
    finally:
        then(conn)


def _more_descriptors() -> None:
    """Raise the soft limit on open descriptors to the hard one: each region is one (pinning ahead makes many)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
