"""Pinned-host backup memory: chunks pinned ahead of the first sleep (in the background), reused across cycles.

Pinning host memory costs far more than copying into it (on an H200 here about
2 GB/s against 55 GB/s), so the :class:`HostArena` pins fixed-size chunks before
they are needed: :meth:`HostArena.want` raises the target (the allocator calls
it when tagged memory grows) and a daemon thread pins towards it. A backup then
:meth:`~HostArena.take`\\ s extents from pinned chunks and gives them back when
the backup is dropped; chunks stay pinned for the next cycle unless the policy
says to give them back after wake.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from torpor.allocator.driver import Driver
from torpor.allocator.errors import AllocatorError, AllocatorOutOfMemory

logger = logging.getLogger("torpor.allocator")
MiB = 1 << 20


@dataclass(frozen=True)
class HostPolicy:
    """How pinned host memory for backups is managed (memory mechanism, not sleep policy).

    ``prepin``: pin in the background as tagged memory grows, so the first sleep
    copies at link speed. ``prepin_exclude``: tags whose growth does not pin
    ahead (``kv_cache`` is discarded at every level of the default policy).
    ``keep_after_wake``: keep chunks pinned after a wake for the next sleep
    (False gives them back once no backup uses them). ``chunk_bytes``: pinning
    unit. ``threads``: threads pinning what a sleep needs now.
    ``background_threads``: threads pinning ahead. Small chunks and one thread
    in the background keep the awake engine's CUDA calls from waiting on the
    pinning (measured: 32 MiB x 1 thread stalled engine steps 13 % of the
    pinning time, at most 2.5 ms each; 256 MiB x 4 threads stalled them all).
    """

    prepin: bool = True
    prepin_exclude: frozenset[str] = frozenset({"kv_cache"})
    keep_after_wake: bool = True
    chunk_bytes: int = 32 * MiB
    threads: int = 4
    background_threads: int = 1


@dataclass(frozen=True)
class Extent:
    """A piece of pinned host memory: ``host`` address and ``nbytes``, inside chunk ``chunk``."""

    host: int
    nbytes: int
    chunk: int


class _Chunk:
    def __init__(self, host: int, nbytes: int) -> None:
        self.host = host
        self.nbytes = nbytes
        self.free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted

    def used(self) -> int:
        return self.nbytes - sum(n for _, n in self.free)

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """Carve up to ``nbytes`` from the first free range; (offset, size) or None."""
        if not self.free:
            return None
        off, size = self.free[0]
        got = min(size, nbytes)
        if got == size:
            self.free.pop(0)
        else:
            self.free[0] = (off + got, size - got)
        return off, got

    def give(self, off: int, nbytes: int) -> None:
        ranges = sorted([*self.free, (off, nbytes)])
        merged: list[tuple[int, int]] = []
        for o, n in ranges:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.free = merged


class HostArena:
    """Pinned host chunks for backups, pinned ahead in a background thread."""

    def __init__(self, driver: Driver, policy: HostPolicy | None = None) -> None:
        self.driver = driver
        self.policy = policy or HostPolicy()
        self._chunks: dict[int, _Chunk] = {}
        self._pinned = 0  # sum of the chunks' sizes, kept as they come and go (thousands of 32 MiB chunks)
        self._cond = threading.Condition()
        self._target = 0
        self._inflight = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self.last_error: BaseException | None = None
        self.pin_seconds = 0.0
        self._paused = 0

    # -- reading ---------------------------------------------------------------------

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory held."""
        with self._cond:
            return self._pinned

    def used_bytes(self) -> int:
        """Bytes of pinned host memory holding backups."""
        with self._cond:
            return sum(c.used() for c in self._chunks.values())

    def free_bytes(self) -> int:
        """Pinned bytes not holding a backup."""
        with self._cond:
            return self._free_locked()

    def _free_locked(self) -> int:
        return sum(n for c in self._chunks.values() for _, n in c.free)

    # -- pinning ahead ----------------------------------------------------------------

    def want(self, nbytes: int) -> None:
        """Have at least ``nbytes`` pinned soon (background; never blocks the caller)."""
        if not self.policy.prepin:
            return
        with self._cond:
            if nbytes <= self._target or self._closed:
                return
            self._target = nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._pinner, name="torpor-host-pinner", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the background pinning reached its target; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: (
                    self._closed
                    or self.last_error is not None
                    or (self._inflight == 0 and self._pinned_locked() >= self._target)
                ),
                timeout,
            )

    def pause(self) -> None:
        """Hold background pinning (and wait for pins in flight): a graph capture is about to start."""
        with self._cond:
            self._paused += 1
            self._cond.wait_for(lambda: self._inflight == 0, timeout=60)

    def resume(self) -> None:
        """Let background pinning go on after :meth:`pause`."""
        with self._cond:
            self._paused = max(self._paused - 1, 0)
            self._cond.notify_all()

    def _pinned_locked(self) -> int:
        return self._pinned

    def _pinner(self) -> None:
        chunk = self.policy.chunk_bytes
        try:
            self.driver.prepare_thread()
        except Exception as exc:  # no pinning ahead; backups pin when they need to
            logger.warning("the host pinning thread could not start: %s", exc)
            with self._cond:
                self.last_error = exc
                self._cond.notify_all()
            return
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._closed
                        or (
                            self.last_error is None
                            and not self._paused
                            and self._pinned_locked() + self._inflight < self._target
                        )
                    )
                )
                if self._closed:
                    return
                missing = self._target - self._pinned_locked() - self._inflight
                count = min(max(1, -(-missing // chunk)), self.policy.background_threads)
                self._inflight += count * chunk
            try:
                self._pin(count, chunk)
            except AllocatorError as exc:
                logger.warning("pinning host memory ahead of sleep failed: %s", exc)
                with self._cond:
                    self.last_error = exc
                    self._cond.notify_all()

    def _pin(self, count: int, chunk: int) -> None:
        """Pin ``count`` chunks in parallel (``_inflight`` already counts them); register those pinned."""
        import time

        start = time.perf_counter()
        errors: list[BaseException] = []

        def one(_: int) -> None:
            try:
                self.driver.prepare_thread()
                host = self.driver.host_alloc(chunk)
            except Exception as exc:  # reported below, as one allocator error
                errors.append(exc)
                return
            with self._cond:
                self._chunks[host] = _Chunk(host, chunk)
                self._pinned += chunk

        try:
            if count == 1:
                one(0)
            else:
                with ThreadPoolExecutor(min(count, self.policy.threads)) as pool:
                    list(pool.map(one, range(count)))
        finally:
            with self._cond:
                self._inflight -= count * chunk
                self.pin_seconds += time.perf_counter() - start
                self._cond.notify_all()
        if errors:
            exc = errors[0]
            pinned = self.pinned_bytes()
            reason = f"pinning {count} x {chunk} host bytes failed ({exc}); {pinned} bytes pinned"
            if getattr(exc, "code", None) == 2 or "out of memory" in str(exc).lower():
                raise AllocatorOutOfMemory("pin host memory", None, reason, call=getattr(exc, "call", "host_alloc"))
            raise AllocatorError("pin host memory", None, reason, call=getattr(exc, "call", "host_alloc"))

    # -- taking and giving ---------------------------------------------------------------

    def take(self, nbytes: int) -> list[Extent]:
        """Extents totalling ``nbytes`` (pinning what is missing now, in parallel); raises AllocatorError."""
        chunk = self.policy.chunk_bytes
        while True:
            with self._cond:
                free = self._free_locked()
                if free >= nbytes:
                    return self._carve(nbytes)
                if self._inflight and free + self._inflight >= nbytes:
                    self._cond.wait()
                    continue
                missing = nbytes - free - self._inflight
                count = -(-missing // chunk)
                self._inflight += count * chunk
            self._pin(count, chunk)

    def _carve(self, nbytes: int) -> list[Extent]:
        out: list[Extent] = []
        left = nbytes
        for key in sorted(self._chunks):
            c = self._chunks[key]
            while left:
                got = c.take(left)
                if got is None:
                    break
                out.append(Extent(c.host + got[0], got[1], key))
                left -= got[1]
            if not left:
                break
        return out

    def give(self, extents: Iterable[Extent]) -> None:
        """Return extents; with ``keep_after_wake`` off, chunks left empty are unpinned."""
        with self._cond:
            for e in extents:
                c = self._chunks.get(e.chunk)
                if c is not None:
                    c.give(e.host - c.host, e.nbytes)
            self._cond.notify_all()
        if not self.policy.keep_after_wake:
            self.trim()

    def trim(self) -> int:
        """Unpin every chunk that holds no backup; return the bytes given back."""
        with self._cond:
            empty = [c for c in self._chunks.values() if c.used() == 0]
            for c in empty:
                del self._chunks[c.host]
                self._pinned -= c.nbytes
            self._target = min(self._target, self._pinned_locked())
        freed = 0
        for c in empty:
            try:
                self.driver.host_free(c.host)
                freed += c.nbytes
            except Exception:  # an unpin that fails only leaks host memory; log it
                logger.exception("unpinning %d host bytes at %#x failed", c.nbytes, c.host)
        return freed

    def close(self) -> None:
        """Stop the pinner and unpin every chunk (backups are lost)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            chunks = list(self._chunks.values())
            self._chunks.clear()
            self._pinned = 0
        if self._thread is not None:
            self._thread.join(timeout=30)
        for c in chunks:
            try:
                self.driver.host_free(c.host)
            except Exception:  # teardown: log and go on
                logger.exception("unpinning %d host bytes at teardown failed", c.nbytes)
