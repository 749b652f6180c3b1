"""Tag bookkeeping: Python's record of each tag, the lock over them, and which tag this thread allocates in.

The native table (:mod:`torpor.allocator.native.table`) knows each tag's allocations
and state (active, frozen, released); :class:`TagBook` keeps what only Python
knows: each tag's backup (:class:`TagState`), the
lock that orders sleep, wake and the graph pool against each other, and the
per-thread stack of tags that ``use_memory_pool`` and a capture push (the
innermost wins). It decides nothing about any tag.

It also keeps the *doors*: which ``use_memory_pool`` blocks are open, by tag and
thread. Torch serves a block's allocations from its pool's cached segments without
asking the library, and a sleeping tag's segments are unmapped, so a block may
start only while its tag is awake (:meth:`enter_block` refuses it otherwise), and a
sleep first closes its tags' doors and waits, bounded, for the blocks open in other
threads to end (:meth:`close_doors`). Lock order (Invariant: the allocator's lock
order, docs/architecture.md): the doors' lock is taken alone or before the native
table's mutex, never while holding :attr:`lock`'s work on the driver
(:meth:`close_doors` is called before the sleep takes :attr:`lock`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from torpor.allocator.native import library as native
from torpor.allocator.native.table import NativeTable, Span
from torpor.allocator.sleepwake.plan import Backups, Piece
from torpor.allocator.squeeze.wakecheck import Sums
from torpor.errors import AllocatorError, BlocksOpen, TagNotAwake
from torpor.statemachine.core.protocol import TagUsage


class Bounds(NamedTuple):
    """The device addresses ``[lo, hi)`` of a batch a sleep copies, then unmaps."""

    lo: int
    hi: int


class InFlight(NamedTuple):
    """A batch whose backup copy is in flight: the event recorded after its copies, and its :class:`Bounds`."""

    event: object  # the driver's event (Driver.record): waited for before the batch is unmapped
    lo: int
    hi: int


@dataclass
class TagState:
    """Python's part of a tag: its backup (host extents per allocation) and the copies still in flight."""

    backed_up: bool = False
    pieces: list[Piece] = field(default_factory=list)  # what the backup holds, keyed by their allocations
    backups: Backups = field(default_factory=dict)  # piece start -> host extents
    pending: list[InFlight] = field(default_factory=list)  # per batch whose copy is in flight
    partial: bool = False  # a failed release could not be undone nor completed: part of the tag is unmapped
    refill: list[Span] = field(default_factory=list)  # partial: ranges mapped back fresh, to copy the backup into
    sums: dict[int, Sums] = field(default_factory=dict)  # piece start -> its chunks' checksums, sealed at release


@dataclass
class _Held:
    """The ``use_memory_pool`` blocks one thread has open in one tag."""

    name: str
    count: int = 0


class TagBook:
    """Each tag's Python record over one native table, and the tag this thread routes allocations to."""

    def __init__(self, table: NativeTable) -> None:
        self.table = table
        self.lock = threading.RLock()
        self.records: dict[str, TagState] = {}
        self._local = threading.local()
        self._doors = threading.Condition(threading.Lock())
        self._open: dict[str, dict[int, _Held]] = {}  # tag -> thread id -> its open blocks
        self._closing: dict[str, str] = {}  # tag -> the sleep that closed its doors (until it ends)
        self._cause: dict[str, str] = {}  # tag -> the last sleep that closed its doors (named in refusals)

    def state(self, tag: str) -> TagState:
        """The record of ``tag`` (its backup); the first use registers the tag with the table."""
        with self.lock:
            record = self.records.get(tag)
            if record is None:
                self.table.tag_id(tag)
                record = self.records[tag] = TagState()
            return record

    def __contains__(self, tag: object) -> bool:
        return tag in self.records

    def current(self) -> str | None:
        """The innermost tag this thread routes allocations to (None outside any)."""
        stack: list[str] = getattr(self._local, "tags", [])
        return stack[-1] if stack else None

    @contextmanager
    def routed(self, tag: str) -> Iterator[None]:
        """Route this thread's allocations to ``tag`` inside the block (nested: the inner tag wins)."""
        stack: list[str] = self._local.__dict__.setdefault("tags", [])
        stack.append(tag)
        try:
            yield
        finally:
            stack.pop()

    # -- the doors: use_memory_pool blocks -------------------------------------------------

    def enter_block(self, tag: str) -> None:
        """A ``use_memory_pool`` block of ``tag`` starts in this thread; :class:`TagNotAwake` unless the tag is awake."""
        with self._doors:
            state = self.table.usage(tag).state
            if tag in self._closing or state != native.ACTIVE:
                asleep = state == native.RELEASED and tag not in self._closing
                raise TagNotAwake(tag, "asleep" if asleep else "going to sleep", self._cause.get(tag, ""))
            thread = threading.current_thread()
            held = self._open.setdefault(tag, {}).setdefault(thread.ident or 0, _Held(thread.name))
            held.count += 1

    def not_awake(self, tag: str) -> tuple[str, str] | None:
        """(state, the sleep that put it there) when ``tag`` is asleep or going to sleep; None while it is awake."""
        with self._doors:
            state = self.table.usage(tag).state
            if tag not in self._closing and state == native.ACTIVE:
                return None
            asleep = state == native.RELEASED and tag not in self._closing
            return ("asleep" if asleep else "going to sleep"), self._cause.get(tag, "")

    def owner(self, address: int) -> str | None:
        """The tag of the allocation that holds ``address`` (None: no allocation of a known tag holds it)."""
        with self.lock:
            tags = list(self.records)
        for tag in tags:
            for start, size, _ in self.table.allocations(tag):
                if start <= address < start + size:
                    return tag
        return None

    def leave_block(self, tag: str) -> None:
        """The block of ``tag`` this thread entered last ended (a sleep waiting for it may go on)."""
        with self._doors:
            ident = threading.get_ident()
            held = self._open.get(tag, {}).get(ident)
            if held is not None:
                held.count -= 1
                if held.count <= 0:
                    del self._open[tag][ident]
            self._doors.notify_all()

    def open_blocks(self, tags: Sequence[str] | None = None) -> list[str]:
        """Each open block: "tag 'weights' in thread 'loader' (2 blocks)", of ``tags`` or of all."""
        with self._doors:
            return self._holders(self._open if tags is None else tags)

    def close_doors(self, tags: Sequence[str], cause: str, timeout: float) -> None:
        """Refuse new blocks of ``tags`` and wait up to ``timeout`` s for those open in other threads to end.

        :class:`BlocksOpen` (doors open again, nothing touched) when a block of them
        stays open past the wait, or is open in this thread (it cannot end while this
        thread waits). ``cause`` is what later refusals name (the sleep, its event).
        """
        me = threading.get_ident()
        deadline = time.monotonic() + timeout
        with self._doors:
            for tag in tags:
                self._closing[tag] = cause
                self._cause[tag] = cause
            while True:
                holders = self._holders(tags)
                if not holders:
                    return
                mine = [t for t in tags if me in self._open.get(t, {})]
                left = deadline - time.monotonic()
                if mine or left <= 0:
                    for tag in tags:
                        self._closing.pop(tag, None)
                    if mine:
                        why = f"this thread is inside a block of {', '.join(repr(t) for t in mine)}"
                    else:
                        why = f"still open after {timeout:g} s"
                    msg = f"cannot sleep: {why}; open: {'; '.join(holders)} (nothing was touched; end the blocks first)"
                    raise BlocksOpen(msg, holders)
                self._doors.wait(left)

    def open_doors(self, tags: Sequence[str]) -> None:
        """The sleep that closed the doors of ``tags`` ended: blocks may start again wherever the tag is awake."""
        with self._doors:
            for tag in tags:
                self._closing.pop(tag, None)

    def _holders(self, tags: Iterable[str]) -> list[str]:
        out = []
        for tag in sorted(tags):
            for held in self._open.get(tag, {}).values():
                out.append(
                    f"tag {tag!r} in thread {held.name!r}" + (f" ({held.count} blocks)" if held.count > 1 else "")
                )
        return out

    def usage(self) -> dict[str, TagUsage]:
        """Bytes per tag: resident, on the host (released with a backup) or discarded, and the allocations."""
        with self.lock:
            out = {}
            for tag, record in self.records.items():
                state, n, count = self.table.usage(tag)
                if state != native.RELEASED and not record.partial:  # partial: a failed release left part unmapped
                    out[tag] = TagUsage(n, 0, 0, count)
                elif record.backed_up:
                    out[tag] = TagUsage(0, n, 0, count)
                else:
                    out[tag] = TagUsage(0, 0, n, count)
            return out

    def tagged_bytes(self, exclude: AbstractSet[str] = frozenset()) -> int:
        """Bytes allocated in every known tag but those in ``exclude``."""
        return sum(self.table.usage(t).nbytes for t in list(self.records) if t not in exclude)


def refuse_partial(operation: str, tags: list[str], records: dict[str, TagState]) -> None:
    """Refuse ``operation`` on a partly released tag: its backup alone holds part of its bytes."""
    for tag in tags:
        record = records.get(tag)
        if record is not None and record.partial:
            msg = f"tag {tag!r} is partly released after a failed release; wake it first (its backup holds the rest)"
            raise AllocatorError(operation, tag, msg)
