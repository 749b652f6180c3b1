"""Free segments of a tag go back: a fresh torch MemPool per ``use_memory_pool`` block, trimmed once its block ended.

Torch keeps the segments of a pool cached after their tensors are freed and
offers no call that releases the free segments of a live ``MemPool``. But torch
allocates from a pool only while a ``use_mem_pool`` block of it is open, so a
pool whose block ended is never allocated from again: a segment it holds
entirely free is dead memory. :class:`BlockPools` gives every block its own
pool and, at the end of a block, when a block of the tag is entered again and
before a sleep, asks the native table to *trim* the segments that the retired
pools of the tag hold entirely free (unmap them and release their physical
memory; the table keeps their address ranges reserved until torch frees them).

A retired pool whose segments are all free and trimmed is dead; destroying it
lets torch free its segments (through the native free, which then gives the
address ranges back). Torch 2.11 aborts the process when a pool is destroyed
while any thread is inside ``use_mem_pool`` or a graph capture
(``captures_underway.empty()``, an internal assert in ``~MemPool`` ->
``emptyCache``), so dead pools are destroyed only at a quiet moment: when no
block and no capture of this allocator is open (counted here, under the lock
every entry takes), and only when this object holds the last reference to the
pool. Until then they cost torch's bookkeeping and reserved address space, no
device memory.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger("torpor.allocator")

Snapshot = Callable[[Any], list[dict[str, Any]]]


class BlockPool:
    """One ``use_memory_pool`` block's torch pool: its tag, whether its block is still open, the segments trimmed."""

    __slots__ = ("mempool", "open", "tag", "trimmed")

    def __init__(self, tag: str, mempool: Any) -> None:
        self.tag = tag
        self.mempool: Any = mempool
        self.open = True
        self.trimmed: set[int] = set()


def free_segment(segment: dict[str, Any]) -> bool:
    """True when torch holds every block of the segment free ("inactive"; a block pending a stream's free is not)."""
    blocks = segment.get("blocks", [])
    return all(b.get("state") == "inactive" for b in blocks) and int(segment.get("allocated_size", 0)) == 0


class BlockPools:
    """The pools of every ``use_memory_pool`` block of one allocator; trims retired ones, destroys dead ones when quiet.

    ``new_pool(tag)`` makes a torch MemPool for ``tag``; ``trim(address)`` gives
    back a segment (the native table's ``trim``); ``snapshot(mempool)`` lists a
    pool's segments with their blocks (torch's pool snapshot).
    """

    def __init__(self, new_pool: Callable[[str], Any], trim: Callable[[int], None], snapshot: Snapshot) -> None:
        self._new_pool = new_pool
        self._trim = trim
        self._snapshot = snapshot
        self._lock = threading.RLock()  # held across torch calls: torch's malloc/free (native) never take it
        self._live: dict[str, list[BlockPool]] = {}  # open pools and retired pools that may hold live blocks
        self._dead: list[BlockPool] = []  # retired, every segment free and trimmed: destroyed when quiet
        self._inside = 0  # open blocks and captures of this allocator
        self.trimmed_bytes = 0
        self.destroyed = 0

    # -- blocks ------------------------------------------------------------------------

    def enter(self, tag: str) -> BlockPool:
        """A block of ``tag`` starts: trim the tag's retired pools, then a fresh pool for this block."""
        with self._lock:
            self._trim_locked([tag])
            self._inside += 1
            try:
                entry = BlockPool(tag, self._new_pool(tag))
            except BaseException:
                self._inside -= 1
                raise
            self._live.setdefault(tag, []).append(entry)
            return entry

    def leave(self, entry: BlockPool) -> None:
        """The block of ``entry`` ended (its ``use_mem_pool`` exited): trim what its tag holds free; destroy if quiet."""
        with self._lock:
            entry.open = False
            self._inside -= 1
            self._trim_locked([entry.tag])

    @contextmanager
    def hold(self) -> Iterator[None]:
        """No pool is destroyed while inside (a graph capture: torch's capture state must stay as it is)."""
        with self._lock:
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                self._destroy_dead_locked()

    # -- trimming ----------------------------------------------------------------------

    def trim(self, tags: list[str] | None = None) -> int:
        """Give back the free segments of retired pools (of ``tags``, or all); the bytes trimmed by this call."""
        with self._lock:
            return self._trim_locked(tags)

    def _trim_locked(self, tags: list[str] | None) -> int:
        before = self.trimmed_bytes
        for tag in list(self._live) if tags is None else tags:
            keep = []
            for entry in self._live.get(tag, []):
                if entry.open or not self._trim_pool(entry):
                    keep.append(entry)
                else:
                    self._dead.append(entry)
            if tag in self._live:
                self._live[tag] = keep
        self._destroy_dead_locked()
        return self.trimmed_bytes - before

    def _trim_pool(self, entry: BlockPool) -> bool:
        """Trim the free segments of a retired pool; True when every segment is free (the pool is dead)."""
        dead = True
        for seg in self._snapshot(entry.mempool):
            address = int(seg["address"])
            if not free_segment(seg):
                dead = False
                continue
            if address in entry.trimmed:
                continue
            try:
                self._trim(address)
            except Exception:  # the table refused (e.g. closed); the segment stays mapped, torch keeps it
                logger.exception("trimming a free segment at %#x of tag %r failed", address, entry.tag)
                dead = False
                continue
            entry.trimmed.add(address)
            self.trimmed_bytes += int(seg.get("total_size", 0))
        return dead

    def _destroy_dead_locked(self) -> None:
        """Destroy dead pools if no block or capture is open and nothing else references them."""
        if self._inside or not self._dead:
            return
        keep = []
        for entry in self._dead:
            # references: entry.mempool and getrefcount's argument; anything more (a graph, a frame) keeps it
            if sys.getrefcount(entry.mempool) > 2 or _use_count(entry.mempool) > 1:
                keep.append(entry)
                continue
            entry.mempool = None  # ~MemPool: torch frees the (trimmed) segments through the native free
            self.destroyed += 1
        self._dead = keep

    # -- queries and teardown -------------------------------------------------------------

    def pools(self, tag: str) -> list[Any]:
        """The torch pools of ``tag`` that may hold live blocks (open, or retired and not dead)."""
        with self._lock:
            return [e.mempool for e in self._live.get(tag, [])]

    def counts(self) -> tuple[int, int, int]:
        """(pools that may hold live blocks, dead pools waiting for a quiet moment, open blocks and captures)."""
        with self._lock:
            return sum(len(v) for v in self._live.values()), len(self._dead), self._inside

    def clear(self) -> None:
        """Drop every pool (teardown: torch frees their segments through the native free)."""
        with self._lock:
            self._live.clear()
            for entry in self._dead:
                entry.mempool = None
            self._dead.clear()


def _use_count(mempool: Any) -> int:
    count = getattr(mempool, "use_count", None)
    return int(count()) if callable(count) else 1
