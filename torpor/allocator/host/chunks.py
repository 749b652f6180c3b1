"""The settings and bookkeeping under :class:`~torpor.allocator.host.offload.HostArena`: its policy, pinned chunks, extents."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

from torpor.errors import AllocatorError, AllocatorOutOfMemory
from torpor.switches import env_switch
from torpor.units import MiB


def _default_threads() -> int:
    # 8 threads faulted in and registered 8 GiB in 0.33 s on the H200 host, 16 in 0.40 s (they contend):
    # benchmarks/probes/probe_cold_pin.py, docs/benchmarks.md
    return max(2, min(8, os.cpu_count() or 4))


STAGED_ENV = "TORPOR_STAGED_SLEEP"


def _default_staged() -> bool:
    """Staged sleeps unless ``TORPOR_STAGED_SLEEP=0`` (for engines that wake right after a cold sleep); a typo is refused."""
    return env_switch(STAGED_ENV)


def _default_stage_threads() -> int:
    # 16 threads copied 8 GiB from the ring into fresh pageable memory in 0.41 s on a freshly started H200
    # machine (benchmarks/probes/probe_staged_copy.py, docs/benchmarks.md); copies into fresh pages scale with threads
    return max(2, min(16, os.cpu_count() or 4))


@dataclass(frozen=True)
class HostPolicy:
    """How pinned host memory for backups is managed (mechanism settings; the controller's policy sets them).

    ``prepin``: pin in the background as tagged memory grows, so the first sleep
    copies at link speed (off by default: the first sleep pins as it copies).
    ``prepin_exclude``: tags whose growth does not pin ahead (none by default:
    the controller passes the tags its policy discards at every level, see
    ``Policy.never_backed_up``). ``keep_after_wake``: keep
    chunks pinned after a wake for the next sleep (False gives them back once no
    backup uses them). ``limit_bytes``: most pinned host bytes held at once (None:
    no limit); a take that would pass it raises :class:`AllocatorOutOfMemory`
    before pinning anything. ``chunk_bytes``: pinning unit. ``threads``: threads
    pinning what a sleep needs now. ``background_threads``: threads pinning
    ahead. Small chunks and one thread in the background keep the awake
    engine's CUDA calls from waiting on the pinning (measured: 32 MiB x 1 thread
    stalled engine steps 13 % of the pinning time, at most 2.5 ms each).

    ``staged``: a sleep that needs chunks not pinned yet copies through a ring of
    ``stage_ring_bytes`` of pinned slots (``stage_slot_bytes`` each) that
    ``stage_threads`` threads copy into the chunks' pageable pages; the chunks
    are registered in the background after the sleep, and a wake waits for them
    (torpor.allocator.host.staging). Off (``TORPOR_STAGED_SLEEP=0`` sets the
    default): such a sleep waits for each chunk's pin before copying into it.
    """

    prepin: bool = False
    prepin_exclude: frozenset[str] = frozenset()
    keep_after_wake: bool = True
    limit_bytes: int | None = None
    chunk_bytes: int = 32 * MiB
    threads: int = field(default_factory=_default_threads)
    background_threads: int = 1
    staged: bool = field(default_factory=_default_staged)
    stage_ring_bytes: int = 512 * MiB
    stage_slot_bytes: int = 16 * MiB
    stage_threads: int = field(default_factory=_default_stage_threads)


@dataclass(frozen=True)
class Extent:
    """A piece of pinned host memory: ``host`` address and ``nbytes``, inside chunk ``chunk``."""

    host: int
    nbytes: int
    chunk: int


class Chunk:
    """A pinned (or reserved, being pinned) host range and its free ranges."""

    def __init__(self, host: int, nbytes: int) -> None:
        self.host = host
        self.nbytes = nbytes
        self.free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted
        self.ready = False  # registered with the driver: copies may target it
        self.staged = False  # filled by a staged sleep's threads (pageable), pinned once the sleep's copies are done
        self.filled = False  # holds a staged sleep's copies: readable as pageable memory even if its pin fails
        self.trim_when_pinned = False  # a trim found it empty while it was being pinned
        self.error: BaseException | None = None

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

    def given(self, off: int, nbytes: int, free: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``free`` with ``[off, off + nbytes)`` added and merged; refused when the range leaves the chunk or is free already."""
        if off < 0 or nbytes <= 0 or off + nbytes > self.nbytes:
            msg = f"extent at offset {off} of {nbytes} bytes is not inside host chunk {self.host:#x} of {self.nbytes} bytes"
            raise AllocatorError("give host memory", None, msg)
        i = bisect.bisect_left(free, (off, 0))
        overlap = (i > 0 and free[i - 1][0] + free[i - 1][1] > off) or (i < len(free) and free[i][0] < off + nbytes)
        if overlap:
            msg = (
                f"extent at offset {off} of {nbytes} bytes of host chunk {self.host:#x} is free already "
                "(given back twice); its chunk's free list is left as it was"
            )
            raise AllocatorError("give host memory", None, msg)
        merged = [*free[:i], (off, nbytes), *free[i:]]
        lo = i - 1 if i > 0 and merged[i - 1][0] + merged[i - 1][1] == off else i
        hi = i + 1 if i + 1 < len(merged) and off + nbytes == merged[i + 1][0] else i
        if lo == hi:
            return merged
        start = merged[lo][0]
        end = merged[hi][0] + merged[hi][1]
        return [*merged[:lo], (start, end - start), *merged[hi + 1 :]]


def new_chunks(missing: int, chunk: int) -> list[int]:
    """Chunk sizes covering ``missing`` bytes: whole chunks, the last one cut to a multiple of 2 MiB (or the chunk)."""
    if missing <= 0:
        return []
    unit = min(chunk, 2 * MiB)
    whole, rest = divmod(missing, chunk)
    return [chunk] * whole + ([-(-rest // unit) * unit] if rest else [])


def carve(chunks: list[Chunk], nbytes: int) -> list[Extent]:
    """Up to ``nbytes`` of extents from ``chunks`` (in order), skipping chunks whose pin failed."""
    out: list[Extent] = []
    left = nbytes
    for c in chunks:
        while left and c.error is None:
            got = c.take(left)
            if got is None:
                break
            out.append(Extent(c.host + got[0], got[1], c.host))
            left -= got[1]
        if not left:
            break
    return out


def closed_error(what: str) -> AllocatorError:
    """The refusal of an arena that was closed."""
    msg = f"the host arena is closed (its allocator was closed); cannot {what} pinned host memory for a backup"
    return AllocatorError("pin host memory", None, msg)


def thread_died(what: str, exc: BaseException) -> AllocatorError:
    """What a pinning thread hit that is no ``Exception`` (it would have died silently), as the error its waiter raises."""
    return AllocatorError("pin host memory", None, f"the {what} thread hit {type(exc).__name__}: {exc}")


def pin_error(exc: BaseException, nbytes: int, pinned: int) -> AllocatorError:
    """The allocator error for a failed pin: out of memory when the driver said so."""
    reason = f"pinning {nbytes} host bytes failed ({exc}); {pinned} bytes pinned"
    call = getattr(exc, "call", "host_alloc")
    if getattr(exc, "code", None) == 2 or "out of memory" in str(exc).lower():
        return AllocatorOutOfMemory("pin host memory", None, reason, call=call)
    return AllocatorError("pin host memory", None, reason, call=call)
