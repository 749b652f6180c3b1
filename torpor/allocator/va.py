"""Virtual address arenas: one per (device, tag), so a tag's allocations sit side by side in address space.

Adjacent allocations let sleep and wake batch driver calls and copies over
contiguous spans. An arena reserves address space in large blocks (address
space is cheap; physical memory is mapped per allocation) and reuses freed
ranges first-fit. Reservations are returned only by :meth:`VaArena.close`.
"""

from __future__ import annotations

from torpor.allocator.driver import Driver

GiB = 1 << 30


def carve(free: list[tuple[int, int]], nbytes: int) -> int | None:
    """Take ``nbytes`` first-fit off a list of (start, size) ranges, in place; the start, or None when none fits."""
    for i, (start, size) in enumerate(free):
        if size >= nbytes:
            if size == nbytes:
                free.pop(i)
            else:
                free[i] = (start + nbytes, size - nbytes)
            return start
    return None


class VaArena:
    """Address ranges for one device and tag, carved from reservations of ``block`` bytes."""

    def __init__(self, driver: Driver, device: int, block: int = 64 * GiB) -> None:
        self.driver = driver
        self.device = device
        self.block = block
        self.reservations: list[tuple[int, int]] = []
        self._free: list[tuple[int, int]] = []  # (start, size), sorted, merged

    def take(self, nbytes: int) -> int:
        """An address range of ``nbytes`` (a multiple of the granularity); reserves more when needed."""
        found = carve(self._free, nbytes)
        if found is not None:
            return found
        block = max(self.block, nbytes)
        start = self.driver.reserve(block, self.device)
        self.reservations.append((start, block))
        if block > nbytes:
            self.give(start + nbytes, block - nbytes)
        return start

    def give(self, start: int, nbytes: int) -> None:
        """Return a range for reuse (merged with its free neighbours)."""
        ranges = sorted([*self._free, (start, nbytes)])
        merged: list[tuple[int, int]] = []
        for s, n in ranges:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged

    def free_bytes(self) -> int:
        """Reserved bytes not handed out."""
        return sum(n for _, n in self._free)

    def close(self) -> None:
        """Free every reservation (call only when nothing in the arena is mapped)."""
        for start, size in self.reservations:
            self.driver.unreserve(start, size)
        self.reservations.clear()
        self._free.clear()
