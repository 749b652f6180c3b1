"""Read-only views a :class:`~torpor.allocator.TaggedAllocator` hands out of its parts, each for the few readers that need it.

The allocator's parts are private (docs/architecture.md, "The allocator's one way
in"); what a reader outside it needs beyond the memory protocol is a method of the
allocator or one of these views, each made over the parts it reads:

- :class:`SlabStats` (``allocator.slabs``): slabs of one-granule allocations (tests, docs/allocator.md);
- :class:`BackupView` (``allocator.backups``): where a tag's backup holds a device range in host memory
  (the keeper's manifest, torch_memory_saver's ``get_cpu_backup``);
- :class:`NativeEntry` (``allocator.native_entry``): the native table as torpor.tms works on it directly
  (its preload library routes raw ``cudaMalloc`` to it; its own backups freeze the tag they copy).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from typing import NamedTuple

from torpor.allocator.host.offload import HostArena
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.plan import clip, copies, host_range
from torpor.allocator.sleepwake.tagbook import TagBook

__all__ = ["BackupView", "HostSpan", "NativeEntry", "SlabStats"]


class SlabStats:
    """Slabs of one-granule allocations, as the native table reports them (see docs/allocator.md)."""

    def __init__(self, table: NativeTable) -> None:
        self._table = table

    def spare_bytes(self, tag: str | None = None) -> int:
        """Mapped bytes in live slabs that no allocation uses (of ``tag``, or of all)."""
        return self._table.stats(tag).spare

    def count(self, tag: str | None = None) -> int:
        """Live slabs (of ``tag``, or of all)."""
        return self._table.stats(tag).slabs


class HostSpan(NamedTuple):
    """Bytes of a backup in host memory: ``[host, host + nbytes)``."""

    host: int  # host address
    nbytes: int


class BackupView:
    """Where the tags' backups hold device bytes in host memory (read, never changed, through this view)."""

    def __init__(self, book: TagBook, host: HostArena) -> None:
        self._book = book
        self._host = host

    def find(self, address: int, nbytes: int) -> tuple[str, list[HostSpan]] | None:
        """The first tag (in the order tags were first used) whose backup holds ``[address, address + nbytes)`` in one piece.

        Returns the tag and the host spans holding those bytes, in order, one per host extent;
        None when no backup holds them all in one backed-up piece (the keeper's manifest).
        """
        for tag, record in self._book.records.items():
            if not record.backed_up:
                continue
            for _, start, size, _ in record.pieces:
                if start <= address and address + nbytes <= start + size:
                    extents = record.backups.get(start, [])
                    return tag, [HostSpan(h, n) for h, n, _, _ in host_range(extents, address - start, nbytes)]
        return None

    def spans(self, tags: Iterable[str], address: int, nbytes: int) -> list[HostSpan] | None:
        """Host spans holding ``[address, address + nbytes)`` in the backup of the first of ``tags`` that holds it all.

        In device-address order, contiguous copies merged, each readable (a staged
        sleep's chunk is waited for); None when no backup of ``tags`` holds every byte.
        """
        hi = address + nbytes
        for tag in tags:
            record = self._book.state(tag)
            if not record.backed_up:
                continue
            parts = clip(record.pieces, address, hi)
            if sum(p.size for p in parts) != nbytes:
                continue
            found = [HostSpan(h, n) for _, _, h, n in sorted(copies(parts, record.backups), key=lambda c: c[1])]
            for span in found:
                self._host.wait_readable(span.host)
            return found
        return None


class NativeEntry:
    """The native table as code outside the allocator works on it directly (torpor.tms).

    A C library binds its context, raw entry points and tag numbers (torpor.tms's preload
    library routes raw ``cudaMalloc`` to it); a backup made outside the allocator freezes
    the tag it copies and thaws it when that fails (torpor.tms's CPU and disk backups).
    """

    def __init__(self, table: NativeTable) -> None:
        self._table = table

    @property
    def context(self) -> int:
        """The table's C context (``tp_ctx *``), the first argument of every entry point."""
        return int(self._table.ctx)

    @property
    def alloc_raw(self) -> ctypes.c_void_p:
        """``tp_alloc_raw``'s address: ``cudaMalloc`` served by the table under a tag number."""
        return ctypes.cast(self._table.lib.tp_alloc_raw, ctypes.c_void_p)

    @property
    def free_synchronized(self) -> ctypes.c_void_p:
        """``tp_free_synchronized``'s address: ``cudaFree`` of the table's memory, the device synchronized first."""
        return ctypes.cast(self._table.lib.tp_free_synchronized, ctypes.c_void_p)

    def tag_id(self, tag: str) -> int:
        """The table's number for ``tag`` (registered on first use), what the entry points take."""
        return self._table.tag_id(tag)

    def freeze(self, tag: str) -> None:
        """Refuse new allocations of ``tag`` while its bytes are copied (Invariant: freeze before copy)."""
        self._table.freeze(tag)

    def thaw(self, tag: str) -> None:
        """Let ``tag`` take allocations again: the copy begun by :meth:`freeze` was called off."""
        self._table.thaw(tag)

    def adopt(self, context: int) -> None:
        """Work on the table ``context`` (which another library opened) instead of this one's own, closed unused.

        Only before anything was allocated: the tag numbers learned so far are forgotten and
        asked again of ``context`` (torpor.tms with ``TMS_INIT_ENABLE=1``).
        """
        self._table.adopt(context)
