"""The keeper's operations: one function per request ``op``, over the :class:`~torpor.keeper.ledger.Ledger` and a connection's :class:`~torpor.keeper.holdings.Session`.

:data:`OPS` maps each op a client may send to its function; each runs under the
keeper's lock, returns the reply and the descriptors that go with it (the
caller closes them once sent), and raises
:class:`~torpor.keeper.refusals.RequestRefused` to refuse. An engine says
``hello`` first (``create``, ``free``, ``publish``, ``retract`` act on its
name); ``claim``/``adopt``, ``map`` and ``adopted`` take a dead engine's
backup over; ``status`` and ``drop`` are an operator's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from torpor.keeper import shmem
from torpor.keeper.fingerprint import ModelIdentity, mismatch
from torpor.keeper.holdings import Backup, Engine, Region, Session
from torpor.keeper.ledger import Ledger
from torpor.keeper.refusals import RequestRefused

__all__ = ["OPS", "Op", "Reply"]

#: A reply and the descriptors sent beside it.
Reply = tuple[dict[str, Any], list[int]]
#: An operation: the records, the connection, the request; its reply.
Op = Callable[[Ledger, Session, dict[str, Any]], Reply]


def _engine_of(session: Session) -> str:
    if session.engine is None:
        raise RequestRefused("usage", "say hello (the engine's name) first")
    return session.engine


def hello(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """Name the engine this connection speaks for (one live process per name)."""
    name = str(request["engine"])
    held = ledger.engines.get(name)
    if held is not None and held.alive and held.pid != session.pid:
        raise RequestRefused("busy", f"engine {name!r} is held by pid {held.pid}, which is alive", pid=held.pid)
    ledger.engines[name] = Engine(name, session.pid)
    session.engine = name
    return {"keeper_pid": os.getpid(), "budget": ledger.budget, "used": ledger.used()}, []


def create(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """A new region for this engine within the budget; its descriptor goes back."""
    engine = _engine_of(session)
    nbytes = int(request["nbytes"])
    if nbytes <= 0:
        raise RequestRefused("usage", f"a region needs a positive size, not {nbytes}")
    used = ledger.used()
    if used + nbytes > ledger.budget:
        message = f"the keeper's budget is {ledger.budget} bytes, {used} are held and {nbytes} more were asked"
        raise RequestRefused("budget", message, budget=ledger.budget, used=used, asked=nbytes)
    rid = ledger.next_id()
    fd = shmem.create_region(f"torpor-keeper-{engine}-{rid}", nbytes)
    ledger.regions[rid] = Region(rid, fd, nbytes, engine, session.pid)
    return {"region": rid, "nbytes": nbytes}, [os.dup(fd)]


def free(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """This engine uses a region no more (it is closed once no backup needs it)."""
    engine = _engine_of(session)
    region = ledger.regions.get(int(request["region"]))
    if region is None or region.engine != engine or region.pid != session.pid:
        raise RequestRefused("usage", f"engine {engine!r} holds no region {request['region']}")
    region.in_use = False
    ledger.collect()
    return {}, []


def publish(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """This engine's backup: its identity and where each tensor's bytes are in its regions."""
    engine = _engine_of(session)
    tensors = dict(request["tensors"])
    needed: set[int] = set()
    for name, entry in tensors.items():
        for rid, offset, n in entry["segments"]:
            region = ledger.regions.get(int(rid))
            mine = region is not None and region.engine == engine and region.pid == session.pid
            if region is None or not mine or not 0 <= offset <= offset + n <= region.nbytes:
                raise RequestRefused("usage", f"tensor {name!r} names bytes outside this engine's regions")
            needed.add(int(rid))
    identity = ModelIdentity.from_dict(request["identity"])
    backup = Backup(
        id=f"{engine}-{session.pid}-{ledger.next_id()}",
        engine=engine,
        pid=session.pid,
        identity=identity.to_dict(),
        tags=[str(t) for t in request.get("tags", [])],
        nbytes=int(request["nbytes"]),
        tensors=tensors,
        regions=needed,
    )
    ledger.backups[engine] = backup
    ledger.collect()
    return {"backup": backup.id}, []


def retract(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """This engine's published backup is stale (it woke)."""
    engine = _engine_of(session)
    backup = ledger.backups.get(engine)
    if backup is not None and backup.pid == session.pid:
        del ledger.backups[engine]
        ledger.collect()
    return {}, []


def status(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """The keeper's state (:meth:`~torpor.keeper.ledger.Ledger.status`)."""
    return ledger.status(), []


def _claimable(ledger: Ledger, session: Session, engine: str) -> Backup:
    """Engine ``engine``'s backup if this connection may adopt it (every check but the identity's)."""
    backup = ledger.backups.get(engine)
    if backup is None:
        raise RequestRefused(
            "refused", "the keeper holds no backup of it (none published, retracted by a wake, or dropped)"
        )
    owner = ledger.engines.get(engine)
    if backup.pid == session.pid:
        raise RequestRefused("refused", "it is this process's own backup (wake instead)")
    if owner is not None and owner.alive and owner.pid == backup.pid:
        raise RequestRefused("refused", f"pid {backup.pid}, which wrote it, is alive")
    if backup.adopter is not None and backup.adopter != session.pid:
        raise RequestRefused("refused", f"pid {backup.adopter} is adopting it")
    return backup


def _grant(ledger: Ledger, session: Session, backup: Backup, verified: bool) -> Reply:
    backup.adopter = session.pid
    session.grant = backup.id
    session.verified = verified
    sizes = {str(r): ledger.regions[r].nbytes for r in backup.regions}
    reply = {"backup": backup.id, "pid": backup.pid, "bytes": backup.nbytes, "tensors": backup.tensors}
    return {**reply, "regions": sizes, "published": backup.published}, []


def claim(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """Hold a backup for this connection before its model exists (mapped and pinned while it is built)."""
    return _grant(ledger, session, _claimable(ledger, session, str(request["engine"])), verified=False)


def adopt(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """Take a dead engine's backup over once its identity matches this process's model."""
    backup = _claimable(ledger, session, str(request["engine"]))
    reason = mismatch(ModelIdentity.from_dict(backup.identity), ModelIdentity.from_dict(request["identity"]))
    if reason is not None:
        if session.grant == backup.id:  # this connection's claim goes: another process may adopt it
            backup.adopter = session.grant = None
        raise RequestRefused("refused", f"the model does not match: {reason}")
    return _grant(ledger, session, backup, verified=True)


def _granted(ledger: Ledger, session: Session) -> Backup:
    backup = next((b for b in ledger.backups.values() if b.id == session.grant), None)
    if backup is None:
        raise RequestRefused("refused", "this connection adopts no backup (adopt first)")
    return backup


def map_region(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """A descriptor of one region of the backup this connection was granted."""
    backup = _granted(ledger, session)
    rid = int(request["region"])
    if rid not in backup.regions:
        raise RequestRefused("refused", f"region {rid} is not part of backup {backup.id}")
    return {"region": rid, "nbytes": ledger.regions[rid].nbytes}, [os.dup(ledger.regions[rid].fd)]


def adopted(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """The granted backup is copied into the new process: the keeper drops it."""
    backup = _granted(ledger, session)
    if not session.verified:
        raise RequestRefused("refused", f"backup {backup.id} is claimed, not checked: adopt it with the identity first")
    del ledger.backups[backup.engine]
    session.grant = None
    ledger.adoptions.append(
        {"backup": backup.id, "engine": backup.engine, "from_pid": backup.pid, "by_pid": session.pid}
        | {"bytes": backup.nbytes, "seconds": float(request.get("seconds", 0.0)), "at": time.time()}
    )
    del ledger.adoptions[:-32]
    ledger.collect()
    return {}, []


def drop(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """An operator drops a dead engine's backup."""
    engine = str(request["engine"])
    backup = ledger.backups.get(engine)
    owner = ledger.engines.get(engine)
    if backup is None:
        raise RequestRefused("refused", f"the keeper holds no backup of engine {engine!r}")
    if owner is not None and owner.alive and owner.pid == backup.pid:
        raise RequestRefused("refused", f"engine {engine!r} (pid {backup.pid}) is alive; it retracts its own backup")
    del ledger.backups[engine]
    ledger.collect()
    return {"dropped": backup.id, "bytes": backup.nbytes}, []


#: Every operation a client may ask for, by its ``op``.
OPS: dict[str, Op] = {
    "hello": hello,
    "create": create,
    "free": free,
    "publish": publish,
    "retract": retract,
    "status": status,
    "claim": claim,
    "adopt": adopt,
    "map": map_region,
    "adopted": adopted,
    "drop": drop,
}
