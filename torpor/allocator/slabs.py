"""Slabs: one mapping shared by many one-granule allocations of a tag, so thousands of small segments cost few driver calls.

Unmapping costs the driver about 25-50 us per mapping on an H200, however the
calls are grouped (one ``cuMemUnmap`` over 2048 adjacent mappings took as long
as 2048 calls), and those calls do not overlap the copies of a sleep. A tag
allocated as 2048 segments of 2 MiB (torch's small-pool segments) therefore
paid 50-100 ms of unmapping on its first sleep, on top of a 78 ms copy. So
allocations of one granule are placed in slabs: a slab is a
:class:`~torpor.allocator.mapping.MappedRange` of several granules, created and
mapped once; its ``freed`` list holds the granules no live allocation uses,
and the next one-granule allocation of the same device and tag takes one of
them without a driver call. Slabs grow by doubling from one granule up to
``max_bytes`` per device and tag, so a tag with few small allocations holds
little spare memory. A slab goes (unmapped, its range back to the arena) when
its last allocation is freed, or with its tag at release; after a wake the
tag's allocations sit in the wake's spans and new small ones open new slabs.
"""

from __future__ import annotations

from torpor.allocator.mapping import MappedRange
from torpor.allocator.va import carve

Key = tuple[int, str]  # (device, tag)


class Slabs:
    """The live slabs of every (device, tag), and how large the next one of each is."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._live: dict[Key, list[MappedRange]] = {}
        self._made: dict[Key, int] = {}

    def enabled(self, size: int, granularity: int) -> bool:
        """Whether an allocation of ``size`` (already rounded to the granularity) goes into a slab."""
        return size == granularity and self.max_bytes > granularity

    def take(self, key: Key, size: int) -> tuple[int, MappedRange] | None:
        """A spare range of ``size`` in a live slab of ``key`` (its user count taken), or None."""
        for m in self._live.get(key, ()):
            if m.handle is None:
                continue
            start = carve(m.freed, size)
            if start is not None:
                m.users += 1
                return start, m
        return None

    def next_size(self, key: Key, granularity: int) -> int:
        """Bytes of the next slab of ``key``: doubling from two granules, at most ``max_bytes``."""
        made = self._made.get(key, 0)
        size = granularity << min(made + 1, 40)
        return max(granularity, min(size, self.max_bytes // granularity * granularity))

    def add(self, key: Key, m: MappedRange, used: int) -> None:
        """Register a new slab whose first ``used`` bytes are taken by its first allocation."""
        if m.size > used:
            m.freed.append((m.start + used, m.size - used))
        self._live.setdefault(key, []).append(m)
        self._made[key] = self._made.get(key, 0) + 1

    def forget(self, key: Key, m: MappedRange) -> None:
        """Drop a slab that was unmapped (its last allocation freed)."""
        live = self._live.get(key)
        if live is not None:
            live[:] = [s for s in live if s is not m]

    def close(self, key: Key) -> None:
        """Drop every slab of ``key``: its tag was released (the slabs were unmapped with it)."""
        self._live.pop(key, None)

    def spare_bytes(self, key: Key | None = None) -> int:
        """Mapped bytes in live slabs that no allocation uses (of ``key``, or of all)."""
        groups = [self._live.get(key, [])] if key is not None else list(self._live.values())
        return sum(n for live in groups for m in live if m.handle is not None for _, n in m.freed)

    def count(self, key: Key | None = None) -> int:
        """Live slabs (of ``key``, or of all)."""
        groups = [self._live.get(key, [])] if key is not None else list(self._live.values())
        return sum(1 for live in groups for m in live if m.handle is not None)
