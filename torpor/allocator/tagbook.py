"""Tag bookkeeping: Python's record of each tag, the lock over them, and which tag this thread allocates in.

The native table (:mod:`torpor.allocator.table`) knows each tag's allocations
and state (active, frozen, released); :class:`TagBook` keeps what only Python
knows: each tag's backup (:class:`~torpor.allocator.sleepwake.TagState`), the
lock that orders sleep, wake and the graph pool against each other, and the
per-thread stack of tags that ``use_memory_pool`` and a capture push (the
innermost wins). It decides nothing about any tag.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from contextlib import contextmanager

from torpor.allocator import native
from torpor.allocator.sleepwake import TagState
from torpor.allocator.table import NativeTable
from torpor.statemachine.protocol import TagUsage


class TagBook:
    """Each tag's Python record over one native table, and the tag this thread routes allocations to."""

    def __init__(self, table: NativeTable) -> None:
        self.table = table
        self.lock = threading.RLock()
        self.records: dict[str, TagState] = {}
        self._local = threading.local()

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

    def usage(self) -> dict[str, TagUsage]:
        """Bytes per tag: resident, on the host (released with a backup) or discarded, and the allocations."""
        with self.lock:
            out = {}
            for tag, record in self.records.items():
                state, n, count = self.table.usage(tag)
                if state != native.RELEASED:
                    out[tag] = TagUsage(n, 0, 0, count)
                elif record.backed_up:
                    out[tag] = TagUsage(0, n, 0, count)
                else:
                    out[tag] = TagUsage(0, 0, n, count)
            return out

    def tagged_bytes(self, exclude: AbstractSet[str] = frozenset()) -> int:
        """Bytes allocated in every known tag but those in ``exclude``."""
        return sum(self.table.usage(t)[1] for t in list(self.records) if t not in exclude)
