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
once, or :data:`MAX_POOLS` where its idle pools held segments still pending (a
block then gets a new pool, so that the pending memory stays reclaimable under
pressure: csrc/trim.c); they go at teardown.

**On by default** (``TORPOR_TRIM_FREE_SEGMENTS=0`` turns it off; ``BlockPools.enabled``).
No block of a tag opens while the tag is asleep or going to sleep
(:meth:`TagBook.enter_block` refuses it), and a sleep waits for the blocks of its tags
that are open: so torch never hands out a cached block of a segment that is unmapped.

**A free segment is unmapped only once no kernel can still touch it.** Torch hands a
freed block back to its pool at once, in stream order: a kernel queued before the
free may still read or write it (an engine's queue is often deep). Torch's own
``cudaFree`` waits for the device; ``cuMemUnmap`` does not, and a kernel that runs
on an unmapped range loses the process's CUDA context (issue 26: a thread filling
tensors behind a busy matmul stream; H200, 2026-12-01). So a block boundary does
not unmap what it finds free: it *marks* it, with an event on each segment's stream
(``mark``), and unmaps it at a later boundary once that event has completed
(``done``) and the segment is still free in the still idle pool. A pool a block
enters again keeps its marked segments mapped (nothing to undo). A sleep trims at
once, after synchronizing the device (:meth:`BlockPools.trim` with ``settled``).
This is the Invariant: stream-ordered trim (docs/architecture.md).

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
import threading
from collections.abc import Callable
from typing import Any

from torpor.switches import env_switch

#: Set to 0 to keep free segments of idle pools mapped (see the module doc); trimming is on by default.
ENV = "TORPOR_TRIM_FREE_SEGMENTS"

logger = logging.getLogger("torpor.allocator")

#: The most pools a tag gets while its idle ones hold segments that queued work may still touch (see ``enter``).
MAX_POOLS = 8

Snapshot = Callable[[Any], list[dict[str, Any]]]
#: Marks the streams of free segments (device, stream handle); the token says when their queued work is done.
Mark = Callable[[set[tuple[int, int]]], object]
Done = Callable[[object], bool]


class BlockPool:
    """One torch pool of a tag: whether a block uses it now, and the segments of it trimmed."""

    __slots__ = ("marked", "mempool", "open", "sizes", "tag", "trimmed")

    def __init__(self, tag: str, mempool: Any) -> None:
        self.tag = tag
        self.mempool: Any = mempool
        self.open = True
        self.trimmed: set[int] = set()
        self.marked: dict[int, object] = {}  # free segment -> the token of the work queued on its stream when found
        self.sizes: dict[int, tuple[int, int]] = {}  # trimmed or free segment -> (device, bytes)


def trim_enabled() -> bool:
    """Whether idle pools are trimmed: on unless ``TORPOR_TRIM_FREE_SEGMENTS=0`` (docs/allocator.md)."""
    return env_switch(ENV)


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
    ``mark(streams) -> token`` records where the work queued on those streams
    ends and ``done(token)`` says whether it has finished (events on CUDA).
    """

    def __init__(
        self,
        new_pool: Callable[[str], Any],
        trim: Callable[[int], bool],
        untrim: Callable[[int], bool],
        snapshot: Snapshot,
        enabled: bool = True,
        *,
        mark: Mark,
        done: Done,
        pend: Callable[[int, int], bool] | None = None,
        unpend: Callable[[int], bool] | None = None,
        wait: Callable[[object], bool] | None = None,
        free_bytes: Callable[[int], int] | None = None,
    ) -> None:
        self._new_pool = new_pool
        self._pend = pend or (lambda _address, _stream: False)
        self._unpend = unpend or (lambda _address: False)
        self._wait = wait or done  # blocks until a mark's work has run; True when it has
        self._free_bytes = free_bytes  # device -> free device bytes (None: never under pressure)
        self._trim = trim
        self._untrim = untrim
        self._snapshot = snapshot
        self._mark = mark
        self._done = done
        self.enabled = enabled  # False: pools are still reused per open block, nothing is trimmed
        self._lock = threading.RLock()  # held across torch calls: torch's malloc/free (native) never take it
        self._pools: dict[str, list[BlockPool]] = {}
        self.trimmed_bytes = 0

    # -- blocks ------------------------------------------------------------------------

    def enter(self, tag: str) -> BlockPool:
        """A block of ``tag`` starts: an idle pool of the tag (its trimmed segments mapped again) or a new one.

        The caller lets a block in only while its tag is awake (:meth:`TagBook.enter_block`):
        torch hands out any cached block of the pool from here on, so every segment of it
        must be mapped. At a quiet moment the tag's idle pools are looked at first: what was
        freed in them since is marked (pending: an allocation under pressure may reclaim it,
        see the module doc). A pool whose marked segments may still be touched by queued
        work is left idle while the tag has fewer than :data:`MAX_POOLS` pools, so that its
        memory stays reclaimable; a pool whose trimmed segments cannot be mapped again (the
        device is full), or could only by taking more than half of the free memory
        (:meth:`_pressed`), stays idle too, and the block gets a new pool. The tag's other idle
        pools are trimmed (what was freed since their blocks ended, once its queued work is done).
        """
        with self._lock:
            pools = self._pools.setdefault(tag, [])
            quiet = self.enabled and self._quiet(None)
            seen = {id(e): self._mark_pool(e) for e in pools if not e.open} if quiet else {}
            busy = {id(e): bool(e.marked) and not all(self._finished_all(e)) for e in pools if not e.open}
            order = sorted((e for e in pools if not e.open), key=lambda e: (busy[id(e)], len(e.trimmed)))
            if order and busy[id(order[0])] and len(pools) < MAX_POOLS:
                order = []  # keep the pending segments reclaimable: a new pool for this block
            if order and len(pools) < MAX_POOLS and self._pressed(order[0]):
                order = []  # under pressure: the trimmed memory stays free for this block's new pool
            chosen = None
            for entry in order:
                self._settle_marks(entry)
                if self._restore(entry):
                    chosen = entry
                    break
            if chosen is None:
                chosen = BlockPool(tag, self._new_pool(tag))
                pools.append(chosen)
            chosen.open = True
            if quiet:
                for entry in pools:
                    if not entry.open and id(entry) in seen:
                        self._trim_ready(entry, seen[id(entry)], settled=False)
            return chosen

    def _pressed(self, entry: BlockPool) -> bool:
        """Whether entering the pool would map back or keep mapped more than the devices can spare.

        Torch's own pool, out of memory, frees its cached segments and retries: memory a
        tag's free segments held serves the next allocation. An idle pool entered again
        maps its trimmed segments back first (torch may hand them out), which under
        pressure takes the room a new allocation of the block needs (issue 38's 1 GiB +
        1.25 GiB); and it keeps its free segments mapped (those freed since, whose queued
        work has run: they are torch's cached blocks again once the block starts, so no
        allocation under pressure may reclaim them). So when a device's free memory, less
        what the trimmed segments would take back, is below what the pool would then hold
        free (trimmed and freed segments), the block gets a new pool: the trimmed memory
        stays free and the freed segments are trimmed at once (their work has run).
        """
        if self._free_bytes is None or not (entry.trimmed or entry.marked):
            return False
        remap: dict[int, int] = {}
        hold: dict[int, int] = {}
        for address in [*entry.trimmed, *entry.marked]:
            device, size = entry.sizes.get(address, (0, 0))
            hold[device] = hold.get(device, 0) + size
            if address in entry.trimmed:
                remap[device] = remap.get(device, 0) + size
        try:
            return any(self._free_bytes(d) - remap.get(d, 0) < n for d, n in hold.items() if n)
        except Exception as exc:  # the device cannot be asked: enter the pool as without pressure
            logger.debug("cannot read the free device memory: %s", exc)
            return False

    def _settle_marks(self, entry: BlockPool) -> None:
        """The pool is about to serve a block: its marked segments are pending no more (those reclaimed meanwhile are trimmed)."""
        for address in list(entry.marked):
            self._drop_mark(entry, address)

    def _drop_mark(self, entry: BlockPool, address: int) -> None:
        entry.marked.pop(address, None)
        try:
            reclaimed = self._unpend(address)
        except Exception:  # the table refused (e.g. closed): nothing was reclaimed
            logger.debug("unpending a segment at %#x of tag %r failed", address, entry.tag, exc_info=True)
            return
        if reclaimed:  # an allocation under pressure trimmed it: map it again before torch may hand it out
            entry.trimmed.add(address)

    def leave(self, entry: BlockPool) -> None:
        """The block of ``entry`` ended (its ``use_mem_pool`` exited): its pool is idle; the tag's idle pools are trimmed."""
        with self._lock:
            entry.open = False
            if self.enabled and self._quiet(None):
                self._trim_locked([entry.tag], settled=False)

    def _quiet(self, mine: BlockPool | None) -> bool:
        """No block of this allocator is open but ``mine``: a block boundary trims only then (see the module doc)."""
        return not any(e.open and e is not mine for v in self._pools.values() for e in v)

    def _restore(self, entry: BlockPool) -> bool:
        """Map the trimmed segments of an idle pool again; False (pool left idle) when the table refuses."""
        for address in sorted(entry.trimmed):
            try:
                self._untrim(address)
            except Exception as exc:  # the device is full (or the tag is not awake): this pool is not used now
                logger.debug("an idle pool of tag %r is not reused: %s", entry.tag, exc)
                return False
            entry.trimmed.discard(address)
            entry.sizes.pop(address, None)
        return True

    # -- trimming ----------------------------------------------------------------------

    def trim(self, tags: list[str] | None = None, *, settled: bool = True) -> int:
        """Give back the free segments of idle pools (of ``tags``, or all); the bytes trimmed by this call.

        ``settled``: the caller synchronized the devices (a sleep), so every free segment
        goes now; otherwise only those whose queued work is done (see the module doc).
        """
        with self._lock:
            return self._trim_locked(tags, settled=settled)

    def empty(self, tags: list[str] | None = None) -> int:
        """Give back every free segment of idle pools (of ``tags``, or all) once its queued work has run; the bytes.

        ``torch.cuda.empty_cache()``'s part for torpor's pools: each free segment is marked
        (an event on its stream), the marks are waited for (``wait``), and what they cover is
        trimmed. A segment whose stream cannot be asked (it captures a graph) stays. Pools a
        block uses now are not touched (torch may hand their segments out).
        """
        with self._lock:
            if not self.enabled:
                return 0
            before = self.trimmed_bytes
            for tag in list(self._pools) if tags is None else tags:
                for entry in self._pools.get(tag, []):
                    if entry.open:
                        continue
                    free = self._mark_pool(entry)
                    waited: set[int] = set()
                    for token in list(entry.marked.values()):
                        if id(token) not in waited:
                            waited.add(id(token))
                            self._wait(token)
                    self._trim_ready(entry, free, settled=False)
            return self.trimmed_bytes - before

    def _trim_locked(self, tags: list[str] | None, *, settled: bool) -> int:
        if not self.enabled:
            return 0
        before = self.trimmed_bytes
        for tag in list(self._pools) if tags is None else tags:
            for entry in self._pools.get(tag, []):
                if not entry.open:
                    self._trim_pool(entry, settled)
        return self.trimmed_bytes - before

    def _trim_pool(self, entry: BlockPool, settled: bool) -> None:
        self._trim_ready(entry, self._mark_pool(entry, settled), settled)

    def _mark_pool(self, entry: BlockPool, settled: bool = False) -> dict[int, dict[str, Any]]:
        """Read an idle pool's free segments; mark (and pend) those freed since, unless ``settled``; the free ones."""
        segments = ((int(seg["address"]), seg) for seg in self._snapshot(entry.mempool))
        free = {a: seg for a, seg in segments if a not in entry.trimmed and free_segment(seg)}
        for address in [a for a in entry.marked if a not in free]:  # used again or given back: not ours
            self._drop_mark(entry, address)
        # what mapping a segment back would take (_pressed): the trimmed ones', and the free ones' (trimmed next)
        kept = {a: entry.sizes[a] for a in entry.trimmed if a in entry.sizes}
        entry.sizes = kept | {a: (int(seg.get("device", 0)), int(seg.get("total_size", 0))) for a, seg in free.items()}
        fresh = [a for a in free if a not in entry.marked]
        if fresh and not settled:  # the work queued on their streams so far may still touch them
            token = self._mark({(int(free[a].get("device", 0)), int(free[a].get("stream", 0))) for a in fresh})
            for address in fresh:
                entry.marked[address] = token
                try:
                    self._pend(address, int(free[address].get("stream", 0)))
                except Exception:  # the table refused (e.g. closed): it stays mapped until a boundary trims it
                    logger.debug("pending a segment at %#x of tag %r failed", address, entry.tag, exc_info=True)
        return free

    def _trim_ready(self, entry: BlockPool, free: dict[int, dict[str, Any]], settled: bool) -> None:
        """Trim the free segments no queued work can touch any more (all of them when ``settled``)."""
        ready = [a for a in free if a not in entry.trimmed] if settled else self._finished(entry)
        for address in ready:
            entry.marked.pop(address, None)
            try:
                if not self._trim(address):  # the tag is going to sleep: its release takes it; trimmed before the wake
                    continue
            except Exception:  # the table refused (e.g. closed); the segment stays mapped, torch keeps it
                logger.exception("trimming a free segment at %#x of tag %r failed", address, entry.tag)
                continue
            entry.trimmed.add(address)
            self.trimmed_bytes += int(free.get(address, {}).get("total_size", 0))

    def _finished_all(self, entry: BlockPool) -> list[bool]:
        """For each marked segment, whether the work queued on its stream when marked has finished."""
        done: dict[int, bool] = {}
        for token in entry.marked.values():
            if id(token) not in done:
                done[id(token)] = self._done(token)
        return [done[id(t)] for t in entry.marked.values()]

    def _finished(self, entry: BlockPool) -> list[int]:
        """The marked segments whose streams finished the work queued when they were marked (asked once a token)."""
        done: dict[int, bool] = {}
        out = []
        for address, token in entry.marked.items():
            if id(token) not in done:
                done[id(token)] = self._done(token)
            if done[id(token)]:
                out.append(address)
        return out

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
