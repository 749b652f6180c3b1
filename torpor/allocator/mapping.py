"""Mappings and copy planning: which device ranges are mapped by which handle, and which copies move a backup.

A :class:`MappedRange` is one ``cuMemMap`` of one physical handle (CUDA maps a
handle only whole). At allocation each allocation gets its own; a wake maps
adjacent allocations of a tag together, one handle per span of up to a batch,
so that thousands of small segments cost a few driver calls. An allocation
freed while others share its mapping keeps its range mapped until the mapping
goes (at the last user's free or at the next sleep).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from torpor.allocator.offload import Extent


class Allocation(Protocol):
    """What the planners read of an allocation."""

    address: int
    size: int
    device: int
    maps: list[MappedRange]
    backup: list[Extent] | None


@dataclass(eq=False)
class MappedRange:
    """One mapped range and its handle (None once unmapped); ``users``: live allocations in it."""

    start: int
    size: int
    handle: object | None
    device: int
    users: int = 1
    freed: list[tuple[int, int]] = field(default_factory=list)

    @property
    def end(self) -> int:
        """First address after the mapping."""
        return self.start + self.size


Piece = tuple[Allocation, int, int]  # an allocation, and the start and size of a range of it


def parts(allocs: Iterable[Allocation]) -> list[tuple[MappedRange, list[Piece]]]:
    """Each distinct mapping of ``allocs`` (by address) with the pieces of the allocations inside it."""
    found: dict[int, tuple[MappedRange, list[Piece]]] = {}
    for a in allocs:
        for m in a.maps:
            lo, hi = max(a.address, m.start), min(a.address + a.size, m.end)
            found.setdefault(id(m), (m, []))[1].append((a, lo, hi - lo))
    return sorted(found.values(), key=lambda e: e[0].start)


def batches(entries: list[tuple[MappedRange, list[Piece]]], nbytes: int) -> list[list[tuple[MappedRange, list[Piece]]]]:
    """Cut mappings (by address) into batches of at least ``nbytes``, one device each."""
    out: list[list[tuple[MappedRange, list[Piece]]]] = []
    current: list[tuple[MappedRange, list[Piece]]] = []
    size = 0
    for entry in entries:
        if current and current[0][0].device != entry[0].device:
            out.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry[0].size
        if size >= nbytes:
            out.append(current)
            current, size = [], 0
    if current:
        out.append(current)
    return out


def spans(pieces: list[Piece], nbytes: int) -> list[list[Piece]]:
    """Group adjacent pieces (same device) into spans of at most ``nbytes`` (a larger piece stands alone)."""
    out: list[list[Piece]] = []
    current: list[Piece] = []
    size = 0
    for piece in pieces:
        a, start, n = piece
        if current:
            last_a, last_start, last_n = current[-1]
            adjacent = last_a.device == a.device and last_start + last_n == start
            if not adjacent or size + n > nbytes:
                out.append(current)
                current, size = [], 0
        current.append(piece)
        size += n
    if current:
        out.append(current)
    return out


def take_front(extents: deque[Extent], nbytes: int) -> list[Extent]:
    """Take the first ``nbytes`` off ``extents`` (cutting an extent when needed); linear in what is taken."""
    head: list[Extent] = []
    while nbytes and extents:
        e = extents.popleft()
        if e.nbytes <= nbytes:
            head.append(e)
            nbytes -= e.nbytes
        else:
            head.append(Extent(e.host, nbytes, e.chunk))
            extents.appendleft(Extent(e.host + nbytes, e.nbytes - nbytes, e.chunk))
            nbytes = 0
    return head


def host_range(extents: list[Extent], offset: int, nbytes: int) -> list[tuple[int, int, int, int]]:
    """(host address, bytes, offset from ``offset``, chunk) covering ``[offset, offset + nbytes)`` of a backup."""
    out = []
    pos = 0
    for e in extents:
        lo, hi = max(offset, pos), min(offset + nbytes, pos + e.nbytes)
        if lo < hi:
            out.append((e.host + lo - pos, hi - lo, lo - offset, e.chunk))
        pos += e.nbytes
    return out


def copies(pieces: list[Piece]) -> list[tuple[int, int, int, int]]:
    """(device, device address, host address, bytes) copies moving the pieces' backups.

    Merged where both sides are contiguous and the host side stays inside one
    pinned chunk: a copy may span device mappings, never two pinned allocations.
    """
    out: list[tuple[int, int, int, int, int]] = []
    for alloc, start, n in pieces:
        for host, m, at, chunk in host_range(alloc.backup or [], start - alloc.address, n):
            address = start + at
            if out:
                d, a, h, k, c = out[-1]
                if d == alloc.device and a + k == address and h + k == host and c == chunk:
                    out[-1] = (d, a, h, k + m, c)
                    continue
            out.append((alloc.device, address, host, m, chunk))
    return [(d, a, h, k) for d, a, h, k, _ in out]
