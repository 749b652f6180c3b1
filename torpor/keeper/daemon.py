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

Access: the socket lives in a 0700 directory and is mode 0600; every
connection's peer uid (``SO_PEERCRED``) must be the keeper's own, or it gets
one refusal and is closed. Regions are never written or read here; a
descriptor goes only to the engine that asked for it, or to the adopter of
the backup that holds it. One thread per connection; one lock over the
records (no call under it blocks on a peer).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import resource
import socket
import threading
import time
from typing import Any

from torpor.keeper import shmem, wire
from torpor.keeper.fingerprint import ModelIdentity, mismatch
from torpor.keeper.holdings import Backup, Engine, Region
from torpor.keeper.refusals import RequestRefused

__all__ = ["Keeper"]

logger = logging.getLogger("torpor.keeper")


class Keeper:
    """A keeper serving ``path`` with at most ``budget_bytes`` in regions; :meth:`serve` blocks, :meth:`start` runs it in a thread."""

    def __init__(self, path: str | os.PathLike[str] | None = None, budget_bytes: int = 64 << 30) -> None:
        if budget_bytes <= 0:
            msg = f"the keeper's budget must be a positive number of bytes, not {budget_bytes}"
            raise ValueError(msg)
        self.path = wire.socket_path(path)
        self.budget = budget_bytes
        self.uid = os.getuid()
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}
        self._backups: dict[str, Backup] = {}  # by engine
        self._engines: dict[str, Engine] = {}
        self._adoptions: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self.started = time.time()
        _more_descriptors()

    # -- running ---------------------------------------------------------------------

    def bind(self) -> None:
        """Make the private directory and listen; refuse if another keeper answers there."""
        wire.private_dir(self.path.parent)
        if self.path.exists() or self.path.is_symlink():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # a keeper that died left its socket
            else:
                probe.close()
                msg = f"a keeper already answers at {self.path}; stop it first or pick another --socket"
                raise RuntimeError(msg)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        listener.listen(64)
        self._listener = listener

    def serve(self) -> None:
        """Accept connections until :meth:`close` (binds first if needed)."""
        if self._listener is None:
            self.bind()
        listener = self._listener
        if listener is None:  # bind sets it
            return
        logger.info("keeper %d serving %s with a budget of %d bytes", os.getpid(), self.path, self.budget)
        while not self._closing:
            try:
                conn, _ = listener.accept()
            except OSError:
                if self._closing:
                    return
                raise
            threading.Thread(target=self._serve_one, args=(conn,), name="torpor-keeper-conn", daemon=True).start()

    def start(self) -> Keeper:
        """Bind and serve in a daemon thread (tests, an engine that hosts its own keeper); returns self."""
        self.bind()
        self._thread = threading.Thread(target=self.serve, name="torpor-keeper", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting, close every region (backups are lost) and remove the socket."""
        self._closing = True
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        with self._lock:
            for r in self._regions.values():
                os.close(r.fd)
            self._regions.clear()
            self._backups.clear()

    # -- one connection ---------------------------------------------------------------

    def _serve_one(self, conn: socket.socket) -> None:
        session: dict[str, Any] = {"engine": None, "grant": None}
        try:
            pid, uid, _ = wire.peer(conn)
            session["pid"] = pid
            if uid != self.uid:
                logger.warning("refused pid %d of uid %d (this keeper serves uid %d only)", pid, uid, self.uid)
                reason = "SO_PEERCRED says another user"
                wire.send(conn, {"error": "denied", "message": reason, "uid": uid, "keeper_uid": self.uid})
                return
            while True:
                try:
                    request, fds = wire.receive(conn)
                except ConnectionError:  # WireClosed is one
                    return
                for fd in fds:  # nobody hands the keeper descriptors
                    os.close(fd)
                reply, out = self._handle(session, request)
                try:
                    wire.send(conn, reply, out)
                finally:
                    for fd in out:
                        os.close(fd)
        except Exception:
            logger.exception("a keeper connection failed")
        finally:
            conn.close()
            self._ended(session)

    def _handle(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        op = request.get("op")
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        if handler is None:
            return {"error": "usage", "message": f"no keeper operation {op!r}"}, []
        try:
            with self._lock:
                result: tuple[dict[str, Any], list[int]] = handler(session, request)
            return result
        except RequestRefused as refusal:
            return refusal.reply, []
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": "usage", "message": f"a malformed {op!r} request: {exc!r}"}, []

    def _engine_of(self, session: dict[str, Any]) -> str:
        name = session["engine"]
        if name is None:
            raise RequestRefused("usage", "say hello (the engine's name) first")
        return str(name)

    # -- operations (under the lock) ----------------------------------------------------

    def _op_hello(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        name = str(request["engine"])
        held = self._engines.get(name)
        if held is not None and held.alive and held.pid != session["pid"]:
            raise RequestRefused("busy", f"engine {name!r} is held by pid {held.pid}, which is alive", pid=held.pid)
        self._engines[name] = Engine(name, session["pid"])
        session["engine"] = name
        return {"keeper_pid": os.getpid(), "budget": self.budget, "used": self._used()}, []

    def _op_create(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        engine = self._engine_of(session)
        nbytes = int(request["nbytes"])
        if nbytes <= 0:
            raise RequestRefused("usage", f"a region needs a positive size, not {nbytes}")
        used = self._used()
        if used + nbytes > self.budget:
            message = f"the keeper's budget is {self.budget} bytes, {used} are held and {nbytes} more were asked"
            raise RequestRefused("budget", message, budget=self.budget, used=used, asked=nbytes)
        rid = next(self._ids)
        fd = shmem.create_region(f"torpor-keeper-{engine}-{rid}", nbytes)
        self._regions[rid] = Region(rid, fd, nbytes, engine, session["pid"])
        return {"region": rid, "nbytes": nbytes}, [os.dup(fd)]

    def _op_free(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        engine = self._engine_of(session)
        region = self._regions.get(int(request["region"]))
        if region is None or region.engine != engine or region.pid != session["pid"]:
            raise RequestRefused("usage", f"engine {engine!r} holds no region {request['region']}")
        region.in_use = False
        self._collect()
        return {}, []

    def _op_publish(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        engine = self._engine_of(session)
        tensors = dict(request["tensors"])
        needed: set[int] = set()
        for name, entry in tensors.items():
            for rid, offset, n in entry["segments"]:
                region = self._regions.get(int(rid))
                mine = region is not None and region.engine == engine and region.pid == session["pid"]
                if region is None or not mine or not 0 <= offset <= offset + n <= region.nbytes:
                    raise RequestRefused("usage", f"tensor {name!r} names bytes outside this engine's regions")
                needed.add(int(rid))
        identity = ModelIdentity.from_dict(request["identity"])
        backup = Backup(
            id=f"{engine}-{session['pid']}-{next(self._ids)}",
            engine=engine,
            pid=session["pid"],
            identity=identity.to_dict(),
            tags=[str(t) for t in request.get("tags", [])],
            nbytes=int(request["nbytes"]),
            tensors=tensors,
            regions=needed,
        )
        self._backups[engine] = backup
        self._collect()
        return {"backup": backup.id}, []

    def _op_retract(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        engine = self._engine_of(session)
        backup = self._backups.get(engine)
        if backup is not None and backup.pid == session["pid"]:
            del self._backups[engine]
            self._collect()
        return {}, []

    def _op_status(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return self.status(), []

    def _claimable(self, session: dict[str, Any], engine: str) -> Backup:
        """Engine ``engine``'s backup if this connection may adopt it (every check but the identity's)."""
        backup = self._backups.get(engine)
        if backup is None:
            raise RequestRefused(
                "refused", "the keeper holds no backup of it (none published, retracted by a wake, or dropped)"
            )
        owner = self._engines.get(engine)
        if backup.pid == session["pid"]:
            raise RequestRefused("refused", "it is this process's own backup (wake instead)")
        if owner is not None and owner.alive and owner.pid == backup.pid:
            raise RequestRefused("refused", f"pid {backup.pid}, which wrote it, is alive")
        if backup.adopter is not None and backup.adopter != session["pid"]:
            raise RequestRefused("refused", f"pid {backup.adopter} is adopting it")
        return backup

    def _grant(self, session: dict[str, Any], backup: Backup, verified: bool) -> tuple[dict[str, Any], list[int]]:
        backup.adopter = session["pid"]
        session["grant"] = backup.id
        session["verified"] = verified
        sizes = {str(r): self._regions[r].nbytes for r in backup.regions}
        reply = {"backup": backup.id, "pid": backup.pid, "bytes": backup.nbytes, "tensors": backup.tensors}
        return {**reply, "regions": sizes, "published": backup.published}, []

    def _op_claim(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Hold a backup for this connection before its model exists (mapped and pinned while it is built)."""
        return self._grant(session, self._claimable(session, str(request["engine"])), verified=False)

    def _op_adopt(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        backup = self._claimable(session, str(request["engine"]))
        reason = mismatch(ModelIdentity.from_dict(backup.identity), ModelIdentity.from_dict(request["identity"]))
        if reason is not None:
            if session["grant"] == backup.id:  # this connection's claim goes: another process may adopt it
                backup.adopter = session["grant"] = None
            raise RequestRefused("refused", f"the model does not match: {reason}")
        return self._grant(session, backup, verified=True)

    def _granted(self, session: dict[str, Any]) -> Backup:
        backup = next((b for b in self._backups.values() if b.id == session["grant"]), None)
        if backup is None:
            raise RequestRefused("refused", "this connection adopts no backup (adopt first)")
        return backup

    def _op_map(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        backup = self._granted(session)
        rid = int(request["region"])
        if rid not in backup.regions:
            raise RequestRefused("refused", f"region {rid} is not part of backup {backup.id}")
        return {"region": rid, "nbytes": self._regions[rid].nbytes}, [os.dup(self._regions[rid].fd)]

    def _op_adopted(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        backup = self._granted(session)
        if not session.get("verified"):
            raise RequestRefused(
                "refused", f"backup {backup.id} is claimed, not checked: adopt it with the identity first"
            )
        del self._backups[backup.engine]
        session["grant"] = None
        self._adoptions.append(
            {"backup": backup.id, "engine": backup.engine, "from_pid": backup.pid, "by_pid": session["pid"]}
            | {"bytes": backup.nbytes, "seconds": float(request.get("seconds", 0.0)), "at": time.time()}
        )
        del self._adoptions[:-32]
        self._collect()
        return {}, []

    def _op_drop(self, session: dict[str, Any], request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        engine = str(request["engine"])
        backup = self._backups.get(engine)
        owner = self._engines.get(engine)
        if backup is None:
            raise RequestRefused("refused", f"the keeper holds no backup of engine {engine!r}")
        if owner is not None and owner.alive and owner.pid == backup.pid:
            raise RequestRefused(
                "refused", f"engine {engine!r} (pid {backup.pid}) is alive; it retracts its own backup"
            )
        del self._backups[engine]
        self._collect()
        return {"dropped": backup.id, "bytes": backup.nbytes}, []

    # -- records -----------------------------------------------------------------------

    def _used(self) -> int:
        return sum(r.nbytes for r in self._regions.values())

    def _collect(self) -> None:
        """Close every region no live engine uses and no backup needs (under the lock)."""
        needed = {r for b in self._backups.values() for r in b.regions}
        for rid in [r.id for r in self._regions.values() if not r.in_use and r.id not in needed]:
            os.close(self._regions.pop(rid).fd)

    def _ended(self, session: dict[str, Any]) -> None:
        """A connection closed: an engine's process is gone (its regions stay only where a backup needs them)."""
        with self._lock:
            name = session.get("engine")
            engine = self._engines.get(str(name)) if name is not None else None
            if engine is not None and engine.pid == session.get("pid") and engine.alive:
                engine.alive = False
                engine.ended = time.time()
                for r in self._regions.values():
                    if r.pid == engine.pid:
                        r.in_use = False
                kept = self._backups.get(engine.name)
                if kept is not None:
                    logger.info("engine %r (pid %d) ended; its backup %s is kept", name, engine.pid, kept.id)
            for b in self._backups.values():
                if b.id == session.get("grant"):
                    b.adopter = None  # an adopter that died before it said adopted: the backup stays
            self._collect()

    def status(self) -> dict[str, Any]:
        """The keeper's state as data: budget, bytes held, engines, backups (tags, bytes, age, model), adoptions."""
        now = time.time()
        engines = [
            {"engine": e.name, "pid": e.pid, "alive": e.alive, "since": e.since, "ended": e.ended}
            for e in self._engines.values()
        ]
        backups = []
        for b in self._backups.values():
            ident = ModelIdentity.from_dict(b.identity)
            backups.append(
                {"backup": b.id, "engine": b.engine, "pid": b.pid, "tags": b.tags, "bytes": b.nbytes}
                | {"tensors": len(b.tensors), "age_s": now - b.published, "model": ident.summary()}
                | {"source": ident.source, "digest": ident.digest(), "adopter": b.adopter}
            )
        return {"keeper_pid": os.getpid(), "socket": str(self.path), "uid": self.uid, "budget": self.budget} | {
            "used": self._used(),
            "regions": len(self._regions),
            "uptime_s": now - self.started,
            "engines": engines,
            "backups": backups,
            "adoptions": list(self._adoptions),
        }


def _more_descriptors() -> None:
    """Raise the soft limit on open descriptors to the hard one: each region is one (pinning ahead makes many)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
