"""How much host memory this process can still fault in: MemAvailable and every cgroup limit above it.

Why it matters: a page fault that finds no memory under a cgroup limit calls
the OOM killer on some process (often this one), while ``MADV_POPULATE_WRITE``
and ``cuMemHostRegister`` fail with ENOMEM, which a sleep turns into a clear
refusal. Faulting by writing is 5-10x faster on the H200 guest
(benchmarks/probes/probe_fault_method.py), so the driver writes only where the room
is clearly there, and populates (slower, fails cleanly) where it is not; a
staged sleep, which fills pageable pages by copying into them, stages only
where the room is there (docs/allocator.md, "Faulting host pages").

Mechanism only: reads ``/proc/meminfo`` and the cgroup (v2, or v1 memory)
files of this process, at most every ``ttl`` seconds, and debits what was
claimed since the last read. No torch, no CUDA.
"""

from __future__ import annotations

import os
import threading
import time

from torpor.units import MiB

__all__ = ["Headroom", "host_headroom"]

_DEFAULT_MARGIN = 512 * MiB


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _number(text: str | None) -> int | None:
    if text is None:
        return None
    word = text.strip()
    return int(word) if word.isdigit() else None  # "max": no limit


class Headroom:
    """Free host bytes as the kernel sees them for this process; :meth:`claim` says whether ``n`` more fit."""

    def __init__(self, root: str = "/", ttl: float = 0.05, margin: int = _DEFAULT_MARGIN) -> None:
        self.root = root
        self.ttl = ttl
        self.margin = margin
        self._lock = threading.Lock()
        self._free: int | None = None
        self._read_at: float | None = None  # never read: the first claim reads, whatever the clock says

    def free_bytes(self) -> int | None:
        """Bytes this process can fault in now: min(MemAvailable, each cgroup's limit - usage); None: unknown."""
        values = [v for v in (self._mem_available(), *self._cgroup_room()) if v is not None]
        return max(min(values), 0) if values else None

    def claim(self, nbytes: int) -> bool:
        """True (and debit ``nbytes``) when they fit with ``margin`` to spare; True when the room is unknown."""
        with self._lock:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at > self.ttl:
                self._free, self._read_at = self.free_bytes(), now
            if self._free is None:
                return True
            if self._free - nbytes < self.margin:
                return False
            self._free -= nbytes
            return True

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _mem_available(self) -> int | None:
        text = _read(self._path("proc", "meminfo"))
        for line in (text or "").splitlines():
            if line.startswith("MemAvailable:"):
                fields = line.split()
                return int(fields[1]) * 1024 if len(fields) > 1 and fields[1].isdigit() else None
        return None

    def _cgroup_room(self) -> list[int | None]:
        """limit - usage of this process's cgroup and each one above it: v2, or the v1 memory hierarchy.

        The walk ends at the mount's root, which is the container's own cgroup
        where the container sees only its own (a cgroup namespace, a bind mount).
        """
        rooms: list[int | None] = []
        mount: tuple[str, ...]
        for line in (_read(self._path("proc", "self", "cgroup")) or "").splitlines():
            hid, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            parts = [p for p in path.strip().split("/") if p]
            if hid == "0" and controllers == "":  # v2: the unified hierarchy
                mount, files = ("sys", "fs", "cgroup"), ("memory.max", "memory.current")
            elif "memory" in controllers.split(","):
                mount, files = ("sys", "fs", "cgroup", "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
            else:
                continue
            for depth in range(len(parts), -1, -1):
                rooms.append(self._room(self._path(*mount, *parts[:depth]), *files))
        return rooms

    @staticmethod
    def _room(base: str, limit_file: str, usage_file: str) -> int | None:
        limit = _number(_read(os.path.join(base, limit_file)))
        usage = _number(_read(os.path.join(base, usage_file)))
        if limit is None or usage is None or limit >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return limit - usage


host_headroom = Headroom()
"""The process's one reading of the host's room (shared by every driver: the pages are this process's)."""
