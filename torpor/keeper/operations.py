"""The keeper's operations: one per request ``op``, over the :class:`~torpor.keeper.ledger.Ledger` and a connection's :class:`~torpor.keeper.holdings.Session`.

:data:`OPS` maps each op a client may send to its :class:`Operation`: ``parse``
checks the request's fields and does the costly work (a manifest's coverage,
the identity's digest) outside the keeper's lock; ``apply`` runs under it,
returns the reply and the descriptors that go with it (the caller closes them
once sent), and raises :class:`~torpor.errors.RequestRefused` to
refuse. An engine says ``hello`` first (``create``, ``free``, ``publish``,
``retract`` act on its name); ``claim``/``adopt``, ``map`` and ``adopted``
take a dead engine's backup over; ``status`` and ``drop`` are an operator's.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torpor.errors import RequestRefused
from torpor.keeper import shmem
from torpor.keeper.fingerprint import ModelIdentity, mismatch
from torpor.keeper.holdings import Backup, Engine, Region, Session
from torpor.keeper.ledger import Ledger
from torpor.statemachine.core.enginename import check_engine_name
from torpor.units import byte_size

__all__ = ["OPS", "Operation", "Reply"]

#: A reply and the descriptors sent beside it.
Reply = tuple[dict[str, Any], list[int]]


@dataclass(frozen=True)
class Operation:
    """One op: ``parse`` (outside the lock: the request checked, turned into what ``apply`` takes), ``apply`` (under it)."""

    apply: Callable[[Ledger, Session, Any], Reply]
    parse: Callable[[dict[str, Any]], Any] = dict


# -- fields ---------------------------------------------------------------------------------------


def _count(request: dict[str, Any], key: str, *, positive: bool = False) -> int:
    value = request.get(key)
    if type(value) is not int or value < (1 if positive else 0):
        kind = "positive" if positive else "non-negative"
        shown = repr(value)[:40]
        raise RequestRefused("usage", f"{key!r} must be a {kind} integer, not {shown}")
    return value


def _name(request: dict[str, Any]) -> str:
    try:
        return check_engine_name(request.get("engine"), refused="; nothing was done")
    except (TypeError, ValueError) as exc:
        raise RequestRefused("usage", str(exc)) from None


def _identity(data: object) -> ModelIdentity:
    if not isinstance(data, dict):
        raise RequestRefused("usage", f"'identity' must be an object, not {type(data).__name__}")
    try:
        return ModelIdentity.from_dict(data)
    except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
        raise RequestRefused("usage", f"a malformed identity: {exc!r}"[:300]) from None


def _engine_of(session: Session) -> str:
    if session.engine is None:
        raise RequestRefused("usage", "say hello (the engine's name) first")
    return session.engine


# -- an engine's own ---------------------------------------------------------------------------


def _hello(ledger: Ledger, session: Session, name: str) -> Reply:
    """Name the engine this connection speaks for (one live process per name; more connections of it are fine)."""
    if session.engine is not None and session.engine != name:
        raise RequestRefused("usage", f"this connection speaks for engine {session.engine!r} already, not {name!r}")
    held = ledger.engines.get(name)
    if held is not None and held.pid != session.pid and ledger.alive(held):
        raise RequestRefused("busy", f"engine {name!r} is held by pid {held.pid}, which is alive", pid=held.pid)
    if session.engine is None:
        if held is not None and held.alive:
            held.connections += 1
        else:
            ledger.engines[name] = Engine(name, session.pid, session.started)
        session.engine = name
    return {"keeper_pid": os.getpid(), "budget": ledger.budget, "used": ledger.used()}, []


def _create(ledger: Ledger, session: Session, nbytes: int) -> Reply:
    """A new region for this engine within the budget; its descriptor goes back."""
    engine = _engine_of(session)
    used = ledger.used()
    if used + nbytes > ledger.budget:
        message = f"the keeper's budget is {byte_size(ledger.budget)}, {byte_size(used)} are held and {byte_size(nbytes)} more were asked"
        raise RequestRefused("budget", message, budget=ledger.budget, used=used, asked=nbytes)
    rid = ledger.next_id()
    try:
        fd = shmem.create_region(f"torpor-keeper-{engine}-{rid}", nbytes)
        try:
            sent = os.dup(fd)
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        short = exc.errno in (errno.EMFILE, errno.ENFILE)
        why = "the keeper is out of file descriptors" if short else "the kernel refused it"
        message = (
            f"{why} ({exc.strerror or exc}): no region of {byte_size(nbytes)} was made for engine {engine!r}; "
            "every backup it holds is kept; ask again once descriptors are freed"
        )
        raise RequestRefused("resources", message) from None
    ledger.regions[rid] = Region(rid, fd, nbytes, engine, session.pid)
    return {"region": rid, "nbytes": nbytes}, [sent]


def _free(ledger: Ledger, session: Session, rid: int) -> Reply:
    """This engine uses a region no more (it is closed once no backup needs it)."""
    engine = _engine_of(session)
    region = ledger.regions.get(rid)
    if region is None or region.engine != engine or region.pid != session.pid:
        raise RequestRefused("usage", f"engine {engine!r} holds no region {rid}")
    region.in_use = False
    ledger.collect()
    return {}, []


@dataclass(frozen=True)
class Manifest:
    """A publish request checked: every tensor of the identity, covered exactly by its segments."""

    identity: ModelIdentity
    digest: str
    summary: str
    tags: list[str]
    nbytes: int
    tensors: dict[str, Any]
    segments: list[tuple[str, int, int, int]]  # (tensor, region, offset, bytes)


def _manifest(request: dict[str, Any]) -> Manifest:
    """Check a manifest outside the lock: each tensor of the identity covered exactly, no other, the total right."""
    identity = _identity(request.get("identity"))
    tensors, nbytes = request.get("tensors"), _count(request, "nbytes")
    if not isinstance(tensors, dict):
        raise RequestRefused("usage", "'tensors' must map each tensor's name to its segments")
    specs = {t.name: t for t in identity.tensors}
    extra = sorted(set(tensors) - set(specs))
    if extra:
        raise RequestRefused("usage", f"tensor {extra[0][:80]!r} is not in the identity ({len(extra)} such)")
    missing = sorted(set(specs) - set(tensors))
    if missing:
        raise RequestRefused("usage", f"tensor {missing[0][:80]!r} of the identity is not in the manifest")
    if nbytes != identity.nbytes:
        raise RequestRefused("usage", f"the manifest's nbytes ({nbytes}) is not the identity's {identity.nbytes}")
    segments: list[tuple[str, int, int, int]] = []
    for name, entry in tensors.items():
        parts = entry.get("segments") if isinstance(entry, dict) else None
        if not isinstance(parts, list):
            raise RequestRefused("usage", f"tensor {name[:80]!r} has no list of segments")
        covered = 0
        for part in parts:
            if not (isinstance(part, list) and len(part) == 3 and all(type(v) is int and v >= 0 for v in part)):
                raise RequestRefused("usage", f"tensor {name[:80]!r}: a segment is [region, offset, bytes] of integers")
            segments.append((name, *part))
            covered += part[2]
        if covered != specs[name].nbytes:
            message = f"tensor {name[:80]!r}: its segments cover {covered} of its {specs[name].nbytes} bytes"
            raise RequestRefused("usage", message)
    tags = request.get("tags", [])
    if not isinstance(tags, list):
        raise RequestRefused("usage", "'tags' must be a list")
    return Manifest(identity, identity.digest(), identity.summary(), [str(t) for t in tags], nbytes, tensors, segments)


def _publish(ledger: Ledger, session: Session, manifest: Manifest) -> Reply:
    """This engine's backup: where each tensor's bytes are, all within its own regions."""
    engine = _engine_of(session)
    needed: set[int] = set()
    for name, rid, offset, n in manifest.segments:
        region = ledger.regions.get(rid)
        mine = region is not None and region.engine == engine and region.pid == session.pid
        if region is None or not mine or offset + n > region.nbytes:
            raise RequestRefused("usage", f"tensor {name[:80]!r} names bytes outside this engine's regions")
        needed.add(rid)
    backup = Backup(
        id=f"{engine}-{session.pid}-{ledger.next_id()}",
        engine=engine,
        pid=session.pid,
        identity=manifest.identity,
        digest=manifest.digest,
        summary=manifest.summary,
        tags=manifest.tags,
        nbytes=manifest.nbytes,
        tensors=manifest.tensors,
        regions=needed,
    )
    ledger.backups[engine] = backup
    ledger.collect()
    return {"backup": backup.id}, []


def _retract(ledger: Ledger, session: Session, _: object) -> Reply:
    """This engine's published backup is stale (it woke)."""
    engine = _engine_of(session)
    backup = ledger.backups.get(engine)
    if backup is not None and backup.pid == session.pid:
        del ledger.backups[engine]
        ledger.collect()
    return {}, []


def _status(ledger: Ledger, session: Session, _: object) -> Reply:
    """The keeper's state (:meth:`~torpor.keeper.ledger.Ledger.status`)."""
    return ledger.status(), []


# -- a dead engine's backup taken over -----------------------------------------------------------


def _claimable(ledger: Ledger, session: Session, engine: str) -> Backup:
    """Engine ``engine``'s backup if this connection may adopt it (every check but the identity's)."""
    backup = ledger.backups.get(engine)
    if backup is None:
        reason = "the keeper holds no backup of it (none published, retracted by a wake, or dropped)"
        raise RequestRefused("refused", reason, engine=engine)
    owner = ledger.engines.get(engine)
    if backup.pid == session.pid:
        raise RequestRefused("refused", "it is this process's own backup (wake instead)", engine=engine)
    if owner is not None and owner.pid == backup.pid and ledger.alive(owner):
        raise RequestRefused("refused", f"pid {backup.pid}, which wrote it, is alive", engine=engine)
    if backup.adopter is not None and backup.adopter != session.pid:
        raise RequestRefused("refused", f"pid {backup.adopter} is adopting it", engine=engine)
    return backup


def _grant(ledger: Ledger, session: Session, backup: Backup, verified: bool) -> Reply:
    backup.adopter = session.pid
    backup.holders.add(session.id)
    session.grants[backup.id] = verified
    sizes = {str(r): ledger.regions[r].nbytes for r in backup.regions}
    reply = {"backup": backup.id, "pid": backup.pid, "bytes": backup.nbytes, "tensors": backup.tensors}
    return {**reply, "regions": sizes, "published": backup.published}, []


def _claim(ledger: Ledger, session: Session, engine: str) -> Reply:
    """Hold a backup for this connection before its model exists (mapped and pinned while it is built)."""
    return _grant(ledger, session, _claimable(ledger, session, engine), verified=False)


def _adopt_request(request: dict[str, Any]) -> tuple[str, ModelIdentity]:
    return _name(request), _identity(request.get("identity"))


def _adopt(ledger: Ledger, session: Session, asked: tuple[str, ModelIdentity]) -> Reply:
    """Take a dead engine's backup over once its identity matches this process's model."""
    engine, identity = asked
    backup = _claimable(ledger, session, engine)
    reason = mismatch(backup.identity, identity)
    if reason is not None:
        if session.grants.pop(backup.id, None) is not None:  # this connection's claim goes: another may adopt
            ledger.let_go(backup, session)
        raise RequestRefused("refused", f"the model does not match: {reason}", engine=engine)
    return _grant(ledger, session, backup, verified=True)


def _granted(ledger: Ledger, session: Session, rid: int | None = None) -> Backup:
    """The backup this connection holds (the one holding region ``rid``, or the only one checked)."""
    held = [b for b in ledger.backups.values() if b.id in session.grants]
    if rid is not None:
        held = [b for b in held if rid in b.regions]
    elif len(held) > 1:
        held = [b for b in held if session.grants[b.id]]
    if not held:
        what = f"no backup holding region {rid}" if rid is not None else "no backup"
        raise RequestRefused("refused", f"this connection adopts {what} (adopt first)")
    if len(held) > 1:
        ids = ", ".join(b.id for b in held)
        raise RequestRefused("refused", f"this connection adopts several backups ({ids}); one connection per adoption")
    return held[0]


def _map(ledger: Ledger, session: Session, rid: int) -> Reply:
    """A descriptor of one region of a backup this connection was granted."""
    backup = _granted(ledger, session, rid)
    try:
        fd = os.dup(ledger.regions[rid].fd)
    except OSError as exc:
        message = f"the keeper is out of file descriptors ({exc.strerror or exc}); the backup is kept; ask again"
        raise RequestRefused("resources", message) from None
    return {"region": rid, "nbytes": ledger.regions[rid].nbytes, "backup": backup.id}, [fd]


def _adopted(ledger: Ledger, session: Session, request: dict[str, Any]) -> Reply:
    """The granted backup is copied into the new process: the keeper drops it."""
    backup = _granted(ledger, session)
    if not session.grants[backup.id]:
        raise RequestRefused("refused", f"backup {backup.id} is claimed, not checked: adopt it with the identity first")
    seconds = request.get("seconds", 0.0)
    del ledger.backups[backup.engine]
    ledger.adoptions.append(
        {"backup": backup.id, "engine": backup.engine, "from_pid": backup.pid, "by_pid": session.pid}
        | {"bytes": backup.nbytes, "seconds": float(seconds) if type(seconds) in (int, float) else 0.0}
        | {"at": time.time()}
    )
    del ledger.adoptions[:-32]
    ledger.collect()
    return {}, []


def _drop(ledger: Ledger, session: Session, engine: str) -> Reply:
    """An operator drops a dead engine's backup."""
    backup = ledger.backups.get(engine)
    owner = ledger.engines.get(engine)
    if backup is None:
        raise RequestRefused("drop", f"nothing to drop: the keeper holds no backup of engine {engine!r}", engine=engine)
    if owner is not None and owner.pid == backup.pid and ledger.alive(owner):
        message = (
            f"engine {engine!r}'s backup {backup.id} was not dropped: pid {backup.pid}, which wrote it, is alive "
            "(it retracts its own backup when it wakes)"
        )
        raise RequestRefused("drop", message, engine=engine)
    del ledger.backups[engine]
    ledger.collect()
    return {"dropped": backup.id, "bytes": backup.nbytes}, []


def _nothing(request: dict[str, Any]) -> None:
    return None


#: Every operation a client may ask for, by its ``op``.
OPS: dict[str, Operation] = {
    "hello": Operation(_hello, _name),
    "create": Operation(_create, lambda r: _count(r, "nbytes", positive=True)),
    "free": Operation(_free, lambda r: _count(r, "region")),
    "publish": Operation(_publish, _manifest),
    "retract": Operation(_retract, _nothing),
    "status": Operation(_status, _nothing),
    "claim": Operation(_claim, _name),
    "adopt": Operation(_adopt, _adopt_request),
    "map": Operation(_map, lambda r: _count(r, "region")),
    "adopted": Operation(_adopted),
    "drop": Operation(_drop, _name),
}
