"""Free segments of a tag go back: torch pools per ``use_memory_pool`` block, trimmed while no block uses them.

Torch keeps the segments of a pool cached after their tensors are freed and
offers no call that releases the free segments of a live ``MemPool``. But torch
allocates from a pool only while a ``use_mem_pool`` block of it is open, so the
segments an *idle* pool holds entirely free are dead memory until a block uses
that pool again. :class:`BlockPools` gives every open block a pool of its own
(an idle pool of the tag, else a new one) and, at the end of a block, when a
block of the tag is entered again and before a sleep, asks the native table to
*trim* the segments the tag's idle pools hold entirely free (unmap them and
release their physical memory; the table keeps the record and the address range
until torch frees the segment). When an idle pool serves a block again its
trimmed segments are *untrimmed* first (fresh memory mapped at the same
addresses), because torch may hand them out from then on.

Pools are reused, not destroyed: torch 2.11 aborts the process when a pool is
destroyed while any thread is inside ``use_mem_pool`` (``captures_underway``
internal assert in ``~MemPool`` -> ``emptyCache``), and making a pool per block
(thousands a second under four allocating threads) crashed it outright
(SIGSEGV in ``torch.cuda.memory_stats`` in another thread; H200, torch 2.11,
2026-11-30). So a tag has at most as many pools as it ever had blocks open at
once; they go at teardown.

**On by default** (``TORPOR_TRIM_FREE_SEGMENTS=0`` turns it off; ``BlockPools.enabled``).
Until 2026-11-30 18:00 UTC it was off: the four-thread GPU test
(tests/test_allocator_threads_gpu.py) crashed with it (SIGSEGV, a corrupted Python
heap). Bisected on the H200: the crash needed blocks of a sleeping tag to get new
pools (their allocations all refused); with those blocks reusing an idle pool
(:meth:`BlockPools.enter`, *dirty* pools mapped again by :meth:`BlockPools.woke`)
it passed. See docs/allocator.md.

A block boundary trims only at a quiet moment, when no other block of the
allocator is open (always so for an engine that allocates from one thread per
device); otherwise the free segments wait for the next quiet block boundary or
the next sleep, which always trims. Each trim reads torch's snapshot of the idle
pools, and four threads entering thousands of blocks a second while a fifth
called ``torch.cuda.memory_stats`` crashed torch 2.11 (SIGSEGV in
``memory_stats``) when every boundary did.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

#: Set to 0 to keep free segments of idle pools mapped (see the module doc); trimming is on by default.
ENV = "TORPOR_TRIM_FREE_SEGMENTS"

logger = logging.getLogger("torpor.allocator")

Snapshot = Callable[[Any], list[dict[str, Any]]]


class BlockPool:
    """One torch pool of a tag: whether a block uses it now, and the segments of it trimmed."""

    __slots__ = ("dirty", "mempool", "open", "tag", "trimmed")

    def __init__(self, tag: str, mempool: Any) -> None:
        self.tag = tag
        self.mempool: Any = mempool
        self.open = True
        self.trimmed: set[int] = set()
        self.dirty = False  # served a block while its tag slept, trimmed segments unmapped: mapped again on the wake


def trim_enabled() -> bool:
    """Whether idle pools are trimmed: on unless ``TORPOR_TRIM_FREE_SEGMENTS=0`` (docs/allocator.md)."""
    value = os.environ.get(ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "off", "on", ""):
        msg = f"{ENV}={value!r} is not a switch (use 1 or 0)"
        raise ValueError(msg)
    return value in ("1", "true", "on", "")


def free_segment(segment: dict[str, Any]) -> bool:
    """True when torch holds every block of the segment free ("inactive"; a block pending a stream's free is not)."""
    blocks = segment.get("blocks", [])
    return all(b.get("state") == "inactive" for b in blocks) and int(segment.get("allocated_size", 0)) == 0


class BlockPools:
    """The torch pools of one allocator's ``use_memory_pool`` blocks: reused per tag, trimmed while idle.

    ``new_pool(tag)`` makes a torch MemPool for ``tag``; ``trim(address) -> bool``
    (False: nothing trimmed, the tag sleeps) and ``untrim(address) -> bool`` are
    the native table's; ``snapshot(mempool)``
    lists a pool's segments with their blocks (torch's pool snapshot);
    ``asleep(tag)`` says whether the table holds the tag asleep or going to sleep
    (no segment of it can be mapped then).
    """

    def __init__(
        self,
        new_pool: Callable[[str], Any],
        trim: Callable[[int], bool],
        untrim: Callable[[int], bool],
        snapshot: Snapshot,
        enabled: bool = True,
        asleep: Callable[[str], bool] | None = None,
    ) -> None:
        self._new_pool = new_pool
        self._trim = trim
        self._untrim = untrim
        self._snapshot = snapshot
        self._asleep = asleep or (lambda tag: False)
        self.enabled = enabled  # False: pools are still reused per open block, nothing is trimmed
        self._lock = threading.RLock()  # held across torch calls: torch's malloc/free (native) never take it
        self._pools: dict[str, list[BlockPool]] = {}
        self.trimmed_bytes = 0

    # -- blocks ------------------------------------------------------------------------

    def enter(self, tag: str) -> BlockPool:
        """A block of ``tag`` starts: an idle pool of the tag (its trimmed segments mapped again) or a new one.

        While the tag sleeps no segment can be mapped: the block reuses the idle pool
        with the fewest trimmed segments anyway (marked *dirty*: :meth:`woke` maps
        them again), as torch would hand out any cached block of a sleeping tag. A
        new pool there would only have its allocations refused, and thousands of
        refused allocations in new pools under threads crashed the process
        (docs/allocator.md). The tag's other idle pools are trimmed (what was freed
        since their blocks ended).
        """
        with self._lock:
            pools = self._pools.setdefault(tag, [])
            chosen = None
            idle = sorted((e for e in pools if not e.open), key=lambda e: len(e.trimmed))
            for entry in idle:
                if self._restore(entry):
                    chosen = entry
                    break
            if chosen is None and idle and self._asleep(tag):
                chosen = idle[0]
                chosen.dirty = True
            if chosen is None:
                chosen = BlockPool(tag, self._new_pool(tag))
                pools.append(chosen)
            chosen.open = True
            if self.enabled and self._quiet(chosen):
                self._trim_locked([tag])
            return chosen

    def leave(self, entry: BlockPool) -> None:
        """The block of ``entry`` ended (its ``use_mem_pool`` exited): its pool is idle; the tag's idle pools are trimmed."""
        with self._lock:
            entry.open = False
            if self.enabled and self._quiet(None):
                self._trim_locked([entry.tag])

    def _quiet(self, mine: BlockPool | None) -> bool:
        """No block of this allocator is open but ``mine``: a block boundary trims only then (see the module doc)."""
        return not any(e.open and e is not mine for v in self._pools.values() for e in v)

    def _restore(self, entry: BlockPool) -> bool:
        """Map the trimmed segments of an idle pool again; False (pool left idle) when the table refuses."""
        for address in sorted(entry.trimmed):
            try:
                self._untrim(address)
            except Exception as exc:  # the tag is asleep, or the device is full: this pool is not used now
                logger.debug("an idle pool of tag %r is not reused: %s", entry.tag, exc)
                return False
            entry.trimmed.discard(address)
        entry.dirty = False
        return True

    def woke(self, tags: list[str]) -> None:
        """The tags are awake again (a wake, or a sleep rolled back): map the trimmed segments of their dirty pools.

        A dirty pool served a block while its tag slept, so torch may have handed
        out parts of its trimmed segments; they get memory again here, before any
        kernel of the awake engine can use them. A pool that cannot (the device is
        full) stays dirty and is tried again when a block enters it.
        """
        with self._lock:
            for tag in tags:
                for entry in self._pools.get(tag, []):
                    if entry.dirty and not self._restore(entry):
                        logger.warning("a pool of tag %r used while asleep could not map its trimmed segments", tag)

    # -- trimming ----------------------------------------------------------------------

    def trim(self, tags: list[str] | None = None) -> int:
        """Give back the free segments of idle pools (of ``tags``, or all); the bytes trimmed by this call."""
        with self._lock:
            return self._trim_locked(tags)

    def _trim_locked(self, tags: list[str] | None) -> int:
        if not self.enabled:
            return 0
        before = self.trimmed_bytes
        for tag in list(self._pools) if tags is None else tags:
            for entry in self._pools.get(tag, []):
                if not entry.open:
                    self._trim_pool(entry)
        return self.trimmed_bytes - before

    def _trim_pool(self, entry: BlockPool) -> None:
        for seg in self._snapshot(entry.mempool):
            address = int(seg["address"])
            if address in entry.trimmed or not free_segment(seg):
                continue
            try:
                if not self._trim(address):  # the tag sleeps: its release took the segment; trimmed after the wake
                    continue
            except Exception:  # the table refused (e.g. closed); the segment stays mapped, torch keeps it
                logger.exception("trimming a free segment at %#x of tag %r failed", address, entry.tag)
                continue
            entry.trimmed.add(address)
            self.trimmed_bytes += int(seg.get("total_size", 0))

    # -- queries and teardown -------------------------------------------------------------

    def pools(self, tag: str) -> list[Any]:
        """The torch pools of ``tag`` (open and idle)."""
        with self._lock:
            return [e.mempool for e in self._pools.get(tag, [])]

    def counts(self) -> tuple[int, int]:
        """(pools, of which open)."""
        with self._lock:
            every = [e for v in self._pools.values() for e in v]
            return len(every), sum(e.open for e in every)

    def clear(self) -> None:
        """Drop every pool (teardown: torch frees their segments through the native free)."""
        with self._lock:
            for entries in self._pools.values():
                for entry in entries:
                    entry.mempool = None
            self._pools.clear()
