"""The records under :class:`~torpor.allocator.host.offload.HostArena`: host chunks reserved, pinned in any thread, given back.

A chunk is reserved (address space, huge pages advised), then pinned: faulted
in and registered with the driver by whichever thread takes it (a sleep's
pinning threads, the pinner ahead, or the background pins after a staged
sleep). Counters: ``_pinned`` (registered), ``_pending`` (reserved, not yet
registered: being pinned, or filled by a staged sleep), ``_staging`` (the
pinned ring of a staged sleep), ``_unpinning`` (a background trim's bytes).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time

from torpor.allocator.host.chunks import Chunk, Extent, HostPolicy, carve, closed_error, thread_died
from torpor.allocator.host.provider import HostProvider
from torpor.allocator.native.driver import Driver

__all__ = ["PinnedChunks"]

logger = logging.getLogger("torpor.allocator")


class PinnedChunks:
    """Host chunks for backups and their counters; :class:`~torpor.allocator.host.offload.HostArena` is the API on them."""

    def __init__(self, driver: Driver, policy: HostPolicy | None = None) -> None:
        self.driver = driver
        self.policy = policy or HostPolicy()
        self._chunks: dict[int, Chunk] = {}
        self._bases: list[int] = []  # sorted chunk addresses, for wait_pinned
        self._pinned = 0  # bytes of registered chunks
        self._pending = 0  # bytes of chunks reserved, not yet registered
        self._pinning = 0  # pins in progress (pause waits for them)
        self._unpinning = 0  # bytes a background trim is still unpinning
        self._staging = 0  # bytes of the pinned ring a staged sleep holds (torpor.allocator.host.staging)
        self._cond = threading.Condition()
        self._target = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._paused = 0
        self.last_error: BaseException | None = None
        self.pin_seconds = 0.0
        self.provider: HostProvider | None = None  # backs ranges reserved from now on (host/provider.py)

    def use_provider(self, provider: HostProvider | None) -> None:
        """Back ranges reserved from now on with ``provider``'s memory (None: the driver's own); held chunks stay."""
        with self._cond:
            self.provider = provider

    def configure(self, **changes: object) -> HostPolicy:
        """Change policy fields (``prepin``, ``keep_after_wake``, ``limit_bytes``, ...); return the new policy."""
        with self._cond:
            self.policy = dataclasses.replace(self.policy, **changes)  # type: ignore[arg-type]
            if not self.policy.prepin:
                self._target = 0
            self._cond.notify_all()
            return self.policy

    # -- reading ---------------------------------------------------------------------

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory held (registered chunks, and a staged sleep's ring)."""
        with self._cond:
            return self._pinned + self._staging

    def held_bytes(self) -> int:
        """Bytes of host memory held for backups: pinned, being pinned, or filled by a staged sleep and not yet pinned."""
        with self._cond:
            return self._pinned + self._pending + self._staging

    def used_bytes(self) -> int:
        """Bytes of pinned host memory holding backups."""
        with self._cond:
            return sum(c.used() for c in self._chunks.values() if c.error is None)

    def free_bytes(self) -> int:
        """Pinned (or being pinned) bytes not holding a backup."""
        with self._cond:
            return self._free_locked()

    def _held_locked(self) -> int:
        """Host bytes counted against the limit: pinned, being pinned, being unpinned, and the staging ring."""
        return self._pinned + self._pending + self._unpinning + self._staging

    def _free_locked(self) -> int:
        return sum(n for c in self._chunks.values() if c.error is None for _, n in c.free)

    # -- chunks ------------------------------------------------------------------------

    def _add_locked(self, host: int, nbytes: int) -> Chunk:
        c = Chunk(host, nbytes)
        self._chunks[host] = c
        bisect.insort(self._bases, host)
        self._pending += nbytes
        return c

    def _remove_locked(self, c: Chunk) -> bool:
        """Take ``c`` out of the records (before its range is unpinned or unreserved); False if it is not there."""
        if self._chunks.get(c.host) is not c:
            return False
        del self._chunks[c.host]
        self._bases.remove(c.host)
        return True

    def _reserve(self, sizes: list[int], wanted: int = 0, staged: bool = False) -> tuple[list[Chunk], list[Extent]]:
        """Reserve chunks of ``sizes`` as one range of address space (not yet pinned); carve ``wanted`` bytes from them.

        ``staged``: the chunks are marked for a staged sleep to fill (nobody pins them until it ends).
        """
        base = self.driver.host_reserve(sum(sizes))
        provider = self.provider
        if provider is not None:
            provider.back(base, sum(sizes))
        out = []
        with self._cond:
            if not self._closed:
                offset = 0
                for n in sizes:
                    out.append(self._add_locked(base + offset, n))
                    out[-1].staged = staged
                    offset += n
                return out, carve(out, wanted)
        # closed meanwhile: no record would ever give this range back
        self._unreserve(Chunk(base, sum(sizes)))
        raise closed_error("take")

    def _pin_chunk(self, c: Chunk, background: bool = False) -> None:
        """Fault in and register one reserved chunk (any thread); failures are kept on the chunk.

        A pin counts in ``_pinning`` until all it does with the range is done, so
        :meth:`close` leaves no thread touching host memory; a pin still queued at
        close does nothing (``close`` gave its range back). ``background``: wait
        while pinning is paused (a graph capture runs).
        """
        with self._cond:
            if background:
                self._cond.wait_for(lambda: self._closed or not self._paused)
            if self._closed or self._chunks.get(c.host) is not c:  # close took it (a pending chunk is only closed away)
                return
            self._pinning += 1
        try:
            self._pin_held(c, background)
        finally:
            with self._cond:
                self._pinning -= 1
                self._cond.notify_all()

    def _pin_held(self, c: Chunk, background: bool = False) -> None:
        start = time.perf_counter()
        try:
            self.driver.prepare_thread()
            if c.filled:  # holds a staged sleep's bytes: register as is (populating may write zeros)
                self.driver.host_register(c.host, c.nbytes)
            else:
                self.driver.host_alloc(c.nbytes, c.host)
        except BaseException as exc:  # kept on the chunk: the copy that needs it raises it (never a silent death)
            with self._cond:
                c.error = exc if isinstance(exc, Exception) else thread_died("pin", exc)
                held = self._chunks.get(c.host) is c
                if held:
                    self._pending -= c.nbytes
                # extents of it are out: it keeps its range (and address) until they come back (give)
                gone = not held or (c.used() == 0 and self._remove_locked(c))
                self._cond.notify_all()
            if gone:
                self._unreserve(c)
            return
        trimmed = False
        with self._cond:
            self.pin_seconds += time.perf_counter() - start
            closed = self._closed or self._chunks.get(c.host) is not c
            if not closed:
                self._pending -= c.nbytes
                # trimmed while it was being pinned (a staged sleep's backup dropped meanwhile), and still empty:
                # unpinned here, counted as a trim's bytes until it is (wait_unpinned)
                trimmed = c.trim_when_pinned and c.used() == 0 and self._remove_locked(c)
                self._unpinning += c.nbytes if trimmed else 0
            if not closed and not trimmed:
                c.ready = True
                self._pinned += c.nbytes
            self._cond.notify_all()
        if trimmed:
            self._unpin_trimmed(c)
        elif closed:
            self._free(c)

    def _unpin_trimmed(self, c: Chunk) -> None:
        """Unpin a chunk a trim took out of the records; its bytes stop counting as being unpinned."""
        self._free(c)
        with self._cond:
            self._unpinning -= c.nbytes
            self._cond.notify_all()

    def _unreserve(self, c: Chunk) -> None:
        try:
            self.driver.host_unreserve(c.host, c.nbytes)
        except Exception:  # only address space leaks
            logger.exception("giving back %d reserved host bytes at %#x failed", c.nbytes, c.host)
        self._forget(c)

    def _free(self, c: Chunk) -> None:
        try:
            self.driver.host_free(c.host)
        except Exception:  # an unpin that fails only leaks host memory; log it
            logger.exception("unpinning %d host bytes at %#x failed", c.nbytes, c.host)
        self._forget(c)

    def _forget(self, c: Chunk) -> None:
        provider = self.provider
        if provider is not None:
            provider.forget(c.host, c.nbytes)
