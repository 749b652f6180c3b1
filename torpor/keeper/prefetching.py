"""A kept backup pinned for copying, possibly before the model exists: :func:`prefetch` as a restarted engine starts.

Why: pinning a kept backup costs more than copying it. On the H200, faulting a
15 GB backup's shmem pages into a new process and registering them took
1.26 s against a 0.27 s copy (benchmarks/probes/probe_adopt_pinning.py). A
restarted engine spends seconds importing and building its model before it can
adopt (8-10 s at 8B in benchmarks/keeper_adopt.py), and the backup's bytes do
not depend on the model. So :func:`prefetch`, called as the process starts,
claims the backup (every keeper check but the identity's), maps its regions
and starts pinning them on threads (:class:`~torpor.keeper.pinnedcopy.PinnedPieces`
with :class:`~torpor.keeper.hostpin.HostPinning`, which holds no GIL: the build
goes on); :func:`torpor.keeper.adopt` later takes it over, has the keeper check
the identity and copies at the host link's speed.

A prefetch never raises for the keeper's reasons: with nothing to claim it
logs why and returns None, and ``adopt()`` then asks (and falls back) as it
would without one. Until it is adopted or closed, the backup is held for this
process (another adopter is refused, naming this pid). After an adoption the
regions are unpinned and unmapped on a thread of their own
(:meth:`Pinned.close_later`; :func:`wait_released` waits for it), off the
loader's path.
"""

from __future__ import annotations

import logging
import os
import threading

from torpor.errors import KeeperError, PinningUnavailable
from torpor.keeper import shmem
from torpor.keeper.hostpin import HostPinning
from torpor.keeper.kept import KeptBackup, claim_backup
from torpor.keeper.pinnedcopy import PinnedPieces
from torpor.keeper.wire import socket_path

__all__ = ["PIN_THREADS", "Pinned", "prefetch", "taken", "wait_released"]

logger = logging.getLogger("torpor.keeper")

#: Threads that pin a backup's regions (at most one per CPU).
PIN_THREADS = 16

_lock = threading.Lock()
_held: dict[tuple[str, str], Pinned] = {}  # prefetched, not adopted yet: (socket, engine) -> its pins
_releasing: list[threading.Thread] = []


class Pinned:
    """A backup mapped here (``kept``) and its regions' pins (``pieces``; None: copied as pageable memory)."""

    def __init__(self, kept: KeptBackup, device: int | None, threads: int = PIN_THREADS) -> None:
        self.kept = kept
        self.pieces: PinnedPieces | None = None
        self._pinning: HostPinning | None = None
        self._closed = False
        if device is not None:
            self.pin(device, threads)

    def pin(self, device: int, threads: int = PIN_THREADS) -> None:
        """Start pinning the regions for copies to GPU ``device`` (no-op if started; logged if CUDA cannot)."""
        if self.pieces is not None:
            return
        try:
            self._pinning = HostPinning(device)
        except PinningUnavailable as exc:
            logger.warning("the kept regions are not pinned (%s); they are copied as pageable memory", exc)
            return
        self.pieces = PinnedPieces(
            self.kept.regions(),
            self._pinning.pin,
            self._pinning.unpin,
            threads=max(1, min(threads, os.cpu_count() or 1)),
            populate=shmem.populate,
        )

    def close(self) -> None:
        """Unpin (after the pins in flight), release the context, unmap; the caller knows no copy still reads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.pieces is not None:
                self.pieces.release()
        finally:
            if self._pinning is not None:
                self._pinning.close()
            self.kept.close()

    def close_later(self) -> None:
        """:meth:`close` on a thread of its own (not a daemon: the process waits for it before it exits)."""
        thread = threading.Thread(target=self._close_logged, name="torpor-adopt-release")
        with _lock:
            _releasing[:] = [t for t in _releasing if t.is_alive()]
            _releasing.append(thread)
        thread.start()

    def _close_logged(self) -> None:
        try:
            self.close()
        except Exception:
            logger.exception("unpinning and unmapping an adopted backup failed")


def prefetch(
    *,
    keeper: str | os.PathLike[str] | None = None,
    engine: str = "default",
    device: int | None = None,
    threads: int = PIN_THREADS,
) -> Pinned | None:
    """Claim engine ``engine``'s kept backup now and pin it for GPU ``device`` in the background; None if nothing to claim.

    Call it as the process starts, before building the model that
    :func:`torpor.keeper.adopt` fills (same ``keeper`` and ``engine``): the
    pins then overlap the build. ``device``: the GPU the model will be on
    (None: map only, copies stay pageable). A second call for the same
    backup returns the first one's.
    """
    key = (str(socket_path(keeper)), engine)
    with _lock:
        if key in _held:
            return _held[key]
    try:
        kept = claim_backup(keeper=keeper, engine=engine)
    except KeeperError as exc:
        logger.info("nothing prefetched from the keeper (%s)", exc)
        return None
    try:
        held = Pinned(kept, device, threads)
    except BaseException:
        kept.close()
        raise
    with _lock:
        _held[key] = held
    logger.info(
        "prefetching backup %s of engine %r (%d bytes) from dead pid %d", kept.id, engine, kept.nbytes, kept.from_pid
    )
    return held


def taken(keeper: str | os.PathLike[str] | None, engine: str) -> Pinned | None:
    """The prefetch of engine ``engine``'s backup from ``keeper``, handed over to the caller (None: none made)."""
    with _lock:
        return _held.pop((str(socket_path(keeper)), engine), None)


def wait_released(timeout: float | None = None) -> bool:
    """Wait for adopted backups still being unpinned and unmapped; whether all are done."""
    with _lock:
        threads = list(_releasing)
    for thread in threads:
        thread.join(timeout)
    return not any(t.is_alive() for t in threads)
