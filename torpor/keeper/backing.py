"""An engine's side of the keeper: its allocator's host backups in keeper regions, published after each sleep.

:func:`attach` connects to the keeper, names the engine and gives the
allocator's host arena a :class:`KeeperBacking` as its host-memory provider
(:class:`~torpor.allocator.HostProvider`): every host range the
arena reserves from then on is a keeper region mapped over it, so the
offload copies write straight into memory the keeper owns (no extra copy; the
arena pins it as before). After each completed sleep it publishes a manifest
(the model's identity and where each tracked tensor's bytes are); a wake
retracts it before anything is restored, so only a backup the device has not
moved past can be adopted.

A keeper that dies, refuses (budget) or was never there changes nothing the
engine does: ranges are then the driver's own memory (as without a keeper),
and the regions already mapped stay mapped and correct (a mapping holds its
memfd's pages). It is said once in the log, counted in :attr:`KeeperBacking.fallbacks`,
and the backups stop surviving a crash.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torpor.allocator import TaggedAllocator
from torpor.errors import BadArgument, KeeperBudgetExceeded, KeeperError
from torpor.keeper import shmem
from torpor.keeper.fingerprint import ModelIdentity
from torpor.keeper.link import KeeperLink
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.machine.controller import SleepController

__all__ = ["KeeperBacking", "attach"]

logger = logging.getLogger("torpor.keeper")


@dataclass(frozen=True)
class _Mapped:
    """A piece of a keeper region mapped over an arena range: the region, the piece's address, size and offset in it.

    A region starts as one piece; each range the arena gives back is cut out at once (the driver
    unmapped it, and the next reservation may take its address), so pieces never overlap.
    """

    region: int
    host: int
    nbytes: int
    offset: int = 0


class KeeperBacking:
    """Host backup memory from a keeper for one engine's allocator (see the module docstring)."""

    def __init__(self, allocator: TaggedAllocator, link: KeeperLink | None, engine: str) -> None:
        self.allocator = allocator
        self.link = link
        self.engine = engine
        self._lock = threading.Lock()
        self._maps: dict[int, _Mapped] = {}  # pieces by address
        self._bases: list[int] = []  # their addresses, sorted
        self._region_bytes: dict[int, int] = {}  # region -> bytes of it still mapped under the arena
        self._identity: ModelIdentity | None = None
        self._addresses: dict[str, int] = {}
        self.backup: str | None = None  # the id of the backup published now (None: none, or retracted)
        self.kept_bytes = 0  # bytes of keeper regions mapped under the arena now
        self.published_bytes = 0  # bytes of the backup published now
        self.fallbacks = 0  # host ranges that stayed the engine's own memory (keeper gone or over budget)
        self.gone: str | None = None if link is not None else "no keeper"
        self._unsubscribe: list[Any] = []

    # -- the host-memory provider ---------------------------------------------------------

    def back(self, host: int, nbytes: int) -> bool:
        """Map a new keeper region over the arena's freshly reserved ``[host, host + nbytes)``; False: left as it was."""
        link = self._live()
        if link is None:
            self.fallbacks += 1
            return False
        try:
            region, fd = link.create(nbytes)
        except KeeperBudgetExceeded as exc:
            self.fallbacks += 1
            logger.warning("%s; %d backup bytes stay in this process's memory (not kept across a crash)", exc, nbytes)
            return False
        except KeeperError as exc:
            self._lost(exc)
            self.fallbacks += 1
            return False
        try:
            shmem.map_over(fd, host, nbytes)
        except OSError as exc:
            logger.warning(
                "mapping keeper region %d failed (%s); the backup stays in this process's memory", region, exc
            )
            self.fallbacks += 1
            self._free(region)
            return False
        finally:
            os.close(fd)
        with self._lock:
            self._add_locked(_Mapped(region, host, nbytes))
            self._region_bytes[region] = nbytes
            self.kept_bytes += nbytes
        return True

    def _add_locked(self, m: _Mapped) -> None:
        self._maps[m.host] = m
        bisect.insort(self._bases, m.host)

    def forget(self, host: int, nbytes: int) -> None:
        """The arena gave ``[host, host + nbytes)`` back; a region given back whole is freed at the keeper."""
        with self._lock:
            m = self._find_locked(host)
            if m is None:
                return
            del self._maps[m.host]
            self._bases.remove(m.host)
            end, top = min(host + nbytes, m.host + m.nbytes), m.host + m.nbytes
            if host > m.host:
                self._add_locked(_Mapped(m.region, m.host, host - m.host, m.offset))
            if end < top:
                self._add_locked(_Mapped(m.region, end, top - end, m.offset + end - m.host))
            self.kept_bytes -= end - host
            self._region_bytes[m.region] -= end - host
            if self._region_bytes[m.region] > 0:
                return
            del self._region_bytes[m.region]
        self._free(m.region)

    def _find_locked(self, host: int) -> _Mapped | None:
        i = bisect.bisect_right(self._bases, host) - 1
        if i < 0:
            return None
        m = self._maps[self._bases[i]]
        return m if host < m.host + m.nbytes else None

    def _free(self, region: int) -> None:
        link = self._live()
        if link is None:
            return
        try:
            link.free(region)
        except KeeperError as exc:
            self._lost(exc)

    def _live(self) -> KeeperLink | None:
        return None if self.gone is not None else self.link

    def _lost(self, exc: BaseException) -> None:
        if self.gone is None:
            self.gone = str(exc)
            logger.warning(
                "the keeper is gone (%s): backups from now on stay in this process's memory and do not survive a "
                "crash; the backups already written are intact (their regions stay mapped here)",
                exc,
            )

    # -- what is published ------------------------------------------------------------------

    def track(self, identity: ModelIdentity, addresses: Mapping[str, int]) -> None:
        """The tensors a backup must hold to be adoptable: ``identity`` and each tensor's device address."""
        missing = sorted({t.name for t in identity.tensors} - set(addresses))
        if missing:
            msg = f"no device address for {len(missing)} tensor(s) of the identity: {', '.join(missing[:5])}"
            raise BadArgument(msg)
        self._identity = identity
        self._addresses = dict(addresses)

    def manifest(self) -> dict[str, Any] | str:
        """The manifest of the backup the allocator holds now, or why there is none to keep (a sentence)."""
        identity = self._identity
        if identity is None:
            return "no tensors are tracked (KeeperBacking.track)"
        tensors: dict[str, Any] = {}
        tags: set[str] = set()
        with self._lock:
            for spec in identity.tensors:
                found = self.allocator.backups.find(self._addresses[spec.name], spec.nbytes)
                if found is None:
                    return f"tensor {spec.name!r} has no host backup (its tag was discarded or is awake)"
                segments = []
                for host, n in found[1]:
                    m = self._find_locked(host)
                    if m is None or host + n > m.host + m.nbytes:
                        return f"tensor {spec.name!r} is backed up in this process's own memory, not the keeper's"
                    segments.append([m.region, m.offset + host - m.host, n])
                if sum(s[2] for s in segments) != spec.nbytes:
                    return f"tensor {spec.name!r}'s backup holds fewer than its {spec.nbytes} bytes"
                tags.add(found[0])
                tensors[spec.name] = {"segments": segments}
        return {"identity": identity.to_dict(), "tags": sorted(tags), "nbytes": identity.nbytes, "tensors": tensors}

    def publish(self) -> str | None:
        """Publish the backup held now (after a sleep); its id, or None (and why in the log) when it cannot be kept."""
        link = self._live()
        if link is None:
            return None
        manifest = self.manifest()
        if isinstance(manifest, str):
            logger.warning("the backup is not kept by the keeper: %s", manifest)
            self.retract()
            return None
        try:
            self.backup = link.publish(manifest)
        except KeeperError as exc:
            self._lost(exc)
            return None
        self.published_bytes = int(manifest["nbytes"])
        return self.backup

    def retract(self) -> None:
        """The published backup is stale (a wake begins)."""
        link = self._live()
        self.backup = None
        self.published_bytes = 0
        if link is None:
            return
        try:
            link.retract()
        except KeeperError as exc:
            self._lost(exc)

    def _on_event(self, event: Event) -> None:
        if event.kind == EventKind.SLEEP_COMPLETED:
            self.publish()
        elif event.kind in (EventKind.WAKE_REQUESTED, EventKind.DISCARD_COMPLETED):
            self.retract()

    def follow(self, controller: SleepController) -> None:
        """Publish after each of ``controller``'s sleeps and retract as each wake (or discard) begins."""
        kinds = [EventKind.SLEEP_COMPLETED, EventKind.WAKE_REQUESTED, EventKind.DISCARD_COMPLETED]
        self._unsubscribe.append(controller.subscribe(self._on_event, kinds))

    def status(self) -> dict[str, Any]:
        """This engine's side: the keeper's socket, bytes in keeper regions, the backup published, fallbacks."""
        with self._lock:
            regions = len(self._region_bytes)
        return {
            "keeper": None if self.link is None else str(self.link.path),
            "engine": self.engine,
            "gone": self.gone,
            "regions": regions,
            "kept_bytes": self.kept_bytes,
            "backup": self.backup,
            "published_bytes": self.published_bytes,
            "fallbacks": self.fallbacks,
        }

    def close(self) -> None:
        """Stop following, stop backing new ranges and close the connection (regions mapped here stay mapped)."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        if self.link is not None:
            self.link.close()
        self.gone = self.gone or "closed"


def attach(
    allocator: TaggedAllocator,
    controller: SleepController | None = None,
    *,
    keeper: str | os.PathLike[str] | None = None,
    engine: str = "default",
    link: KeeperLink | None = None,
) -> KeeperBacking:
    """Back ``allocator``'s host backups with a keeper's memory; follow ``controller``'s sleeps and wakes.

    No keeper at ``keeper`` (or one that refuses this process) is no error:
    the allocator keeps its own memory, the log says why, and the returned
    backing's ``gone`` holds the reason. The backing is the allocator's host
    provider either way, so that telemetry shows the keeper down and counts
    each range it could not back (``fallbacks``).
    """
    started = time.perf_counter()
    try:
        link = link or KeeperLink(keeper)
        link.hello(engine)
    except KeeperError as exc:
        if link is not None:
            link.close()
        logger.warning("no keeper for engine %r (%s): host backups stay in this process's memory", engine, exc)
        backing = KeeperBacking(allocator, None, engine)
        backing.gone = str(exc)
        allocator.use_host_provider(backing)  # backs nothing (gone); counts each range left in-process
        return backing
    backing = KeeperBacking(allocator, link, engine)
    allocator.use_host_provider(backing)
    if controller is not None:
        backing.follow(controller)
    logger.info(
        "engine %r keeps its host backups in the keeper at %s (%.3f s)",
        engine,
        link.path,
        time.perf_counter() - started,
    )
    return backing
