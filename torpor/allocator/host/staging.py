"""A staged sleep: device -> a small ring of pinned slots -> threads copy each slot into the backup's pageable pages.

Why: on a freshly started H200 machine the first sleep's own pinning (fault
8 GiB in, register it, copy into it) took 2.0-2.3 s, 13-15x the copy floor,
while copying the same 8 GiB through a 512 MiB pinned ring into fresh pageable
pages with 16 threads took 0.41 s (2.66x), and registering those pages
afterwards took 0.33 s (benchmarks/probes/probe_staged_copy.py, docs/benchmarks.md).
So a sleep that needs host chunks not yet pinned copies through the ring; the
arena registers the chunks in the background once the sleep's copies are done
(:meth:`~torpor.allocator.host.offload.HostArena.end_staging`), and a wake waits for
them (:meth:`~torpor.allocator.host.offload.HostArena.wait_readable`).

The ring is reserved at the first staged copy of a sleep; each thread pins its
own slots before it copies (pinning 512 MiB from one thread took 0.15 s of a
0.63 s first sleep on a fresh H200 machine), and every slot is given back at
:meth:`Stager.finish`. Its bytes count against the host limit while it lives
(the arena reserved them in ``take``); a slot that cannot be pinned leaves a
smaller ring, and no slot at all makes the sleep pin its chunks instead. Each slot's device-to-host copy is
ordered on the device's copy stream; a thread waits for the slot's event,
copies the slot out with :meth:`~torpor.allocator.native.driver.Driver.host_copy`
and hands the slot back. Mechanism only: whether to stage is the arena's
policy (``HostPolicy.staged``).
"""

from __future__ import annotations

import logging
import queue
import threading

from torpor.allocator.failures import wrap
from torpor.allocator.host.offload import HostArena
from torpor.allocator.native.driver import Driver
from torpor.errors import AllocatorError

__all__ = ["Stager"]

logger = logging.getLogger("torpor.allocator")

_Work = tuple[object, int, list[tuple[int, int, int]]]  # (event, slot, [(host destination, slot offset, bytes)])


class Stager:
    """The copies of one staged sleep; :meth:`copy` enqueues, :meth:`finish` waits, :meth:`abort` gives up."""

    def __init__(self, driver: Driver, arena: HostArena) -> None:
        self.driver = driver
        self.arena = arena
        self._slot = 0
        self._slots: list[int] = []  # the ring's slots (none: no staged sleep under way); each thread pins its own
        self._pinned_slots: list[int] = []
        self._unpinnable = 0
        self._no_ring: BaseException | None = None
        self._free: queue.Queue[int] = queue.Queue()
        self._work: queue.Queue[_Work | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._slot_at: int | None = None  # the slot being filled, its bytes used, its pieces, its device
        self._used = 0
        self._pieces: list[tuple[int, int, int]] = []
        self._device = 0
        self._unsynced: set[int] = set()  # devices whose copies into a slot got no event: synchronized before unpinning
        self.copied = 0  # bytes copied through the ring by the current (or last) staged sleep

    def copy(self, host: int, address: int, nbytes: int, device: int) -> bool:
        """Enqueue a copy of device ``address`` into ``host`` (a staged chunk) through the ring.

        Small copies share a slot (one event per slot, whatever its pieces);
        blocks while every slot is in use. False (nothing enqueued) when the
        ring cannot be pinned: the caller pins the chunk and copies into it
        directly. Raises :class:`~torpor.errors.AllocatorError` with the first
        failed copy of this sleep.
        """
        if not self._slots and not self._open():
            return False
        self._raise_failed()
        off = 0
        while off < nbytes:
            if self._slot_at is None or self._used == self._slot or self._device != device:
                self._flush()
                slot = self._free.get()
                if not slot:  # no slot could be pinned, so nothing went through the ring: pin the chunks instead
                    failed = self._no_ring
                    self._stop()
                    self._raise_failed()  # a thread hit something other than a failed pin: the sleep fails
                    self._give_up(failed or AllocatorError("staging", None, "no staging slot could be pinned"))
                    return False
                self._slot_at = slot
                self._device = device
                self._raise_failed()
            n = min(self._slot - self._used, nbytes - off)
            self.driver.copy_d2h(self._slot_at + self._used, address + off, n, device)
            self._pieces.append((host + off, self._used, n))
            self._used += n
            off += n
        return True

    def finish(self) -> None:
        """Wait for every copy, stop the threads and unpin the ring; raise the first failed copy."""
        self._stop()
        try:
            self._raise_failed()
        finally:
            self._error = None

    def abort(self) -> None:
        """Like :meth:`finish`, but a failed copy is only logged (the backup is being thrown away)."""
        self._stop()
        if self._error is not None:
            logger.debug("a staged copy failed while its backup was being dropped: %s", self._error)
        self._error = None

    # -- internals ------------------------------------------------------------------------

    def _open(self) -> bool:
        """Reserve the ring and start the threads; each pins its own slots first (in parallel), then copies."""
        nbytes = self.arena.staging_bytes()
        if nbytes <= 0:
            return False
        self._slot = min(self.arena.policy.stage_slot_bytes, nbytes)
        size = nbytes - nbytes % self._slot
        try:
            ring = self.driver.host_reserve(size)
        except Exception as exc:  # the caller pins chunks instead: slower, same result
            self._give_up(exc)
            return False
        self._slots = list(range(ring, ring + size, self._slot))
        self._pinned_slots, self._unpinnable = [], 0
        self.copied = 0
        threads = max(1, min(self.arena.policy.stage_threads, len(self._slots)))
        self._threads = [
            threading.Thread(target=self._run, args=(self._slots[i::threads],), name=f"torpor-stage-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()
        return True

    def _give_up(self, exc: BaseException) -> None:
        logger.warning("pinning host memory for a staged sleep failed (%s); pinning the backup instead", exc)
        self.arena.end_staging()

    def _pin_slots(self, slots: list[int]) -> None:
        """Pin this thread's slots (fault in, register) and hand each to the copies; a slot that fails is given back."""
        for slot in slots:
            try:
                self.driver.host_alloc(self._slot, slot)
            except BaseException as exc:  # an Exception leaves a smaller ring; anything else fails the sleep too
                if not isinstance(exc, Exception):
                    self._fail(exc)
                try:
                    self.driver.host_unreserve(slot, self._slot)
                except Exception:  # only address space leaks
                    logger.exception("giving back a staging slot at %#x failed", slot)
                with self._lock:
                    self._unpinnable += 1
                    if self._unpinnable == len(self._slots):  # no slot at all: wake the copy that waits for one
                        self._no_ring = exc
                        self._free.put(0)
                continue
            with self._lock:
                self._pinned_slots.append(slot)
            self._free.put(slot)

    def _run(self, slots: list[int]) -> None:
        """A staging thread: whatever it hits is kept for the sleep to raise; it never dies holding a slot back."""
        try:
            self.driver.prepare_thread()
        except BaseException as exc:  # not only Exception: a dead thread's slots would never reach the ring
            self._fail(exc)
        self._pin_slots(slots)
        while (item := self._work.get()) is not None:
            event, slot, pieces = item
            try:
                self.driver.wait(event)  # the slot holds the device's bytes now
                for host, off, n in pieces:
                    if self._error is None:
                        self.driver.host_copy(host, slot + off, n)
                        with self._lock:
                            self.copied += n
            except BaseException as exc:  # kept for the sleep to raise; the thread goes on handing slots back
                self._fail(exc)
            finally:
                self._free.put(slot)

    def _flush(self) -> None:
        """Hand the slot being filled to the threads (after an event on its copies)."""
        slot, self._slot_at = self._slot_at, None
        if slot is None:
            return
        pieces, self._pieces, self._used = self._pieces, [], 0
        if not pieces:
            self._free.put(slot)
            return
        try:
            event = self.driver.record(self._device)
        except BaseException:
            self._unsynced.add(self._device)  # the slot's copies may still run: _stop syncs before unpinning
            self._free.put(slot)
            raise
        self._work.put((event, slot, pieces))

    def _synchronized(self) -> bool:
        """Wait for the copy streams whose last slot got no event; False: a slot may still be written (leak it)."""
        devices, self._unsynced = self._unsynced, set()
        for device in sorted(devices):
            try:
                self.driver.synchronize(device)
            except Exception:
                logger.exception("synchronizing device %d after a failed staging event failed", device)
                return False
        return True

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc

    def _raise_failed(self) -> None:
        failed = self._error
        if failed is not None:
            raise wrap("backup", None, failed, "a copy through the staging ring") from failed

    def _stop(self) -> None:
        if not self._slots:
            return
        try:
            self._flush()
        except BaseException as exc:  # the copies of the last slot cannot be waited for: the sleep fails
            self._fail(exc)
        for _ in self._threads:
            self._work.put(None)
        for t in self._threads:
            t.join()
        self._threads = []
        while not self._free.empty():
            self._free.get_nowait()
        self._slots, self._no_ring = [], None
        if not self._synchronized():
            logger.error("the ring's copies could not be waited for; its %d slots stay pinned", len(self._pinned_slots))
            self._pinned_slots = []
            return
        for slot in self._pinned_slots:
            try:
                self.driver.host_free(slot)
            except Exception:  # only host memory leaks
                logger.exception("unpinning a %d-byte staging slot at %#x failed", self._slot, slot)
        self._pinned_slots = []
