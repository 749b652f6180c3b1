"""``get_cpu_backup``: the host copy a pause made of a tensor's bytes, read from torpor's backup of its tag.

TMS returns a view of its ``cudaMallocHost``/mmap shadow; torpor's backup of
a paused tag lives in its pinned host arena, split into extents, so a
zero-copy view is given when the tensor's bytes lie in one extent, and a copy
otherwise (said in docs/tms.md). Awake tags have no backup (torpor drops it
once a wake completed): ``None``, or with ``retain_cpu_backup`` a fresh copy of
the device bytes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

from torpor.allocator import TaggedAllocator
from torpor.errors import TmsUsageError

Span = tuple[int, int]  # host address, bytes


def backup_spans(allocator: TaggedAllocator, tags: Iterable[str], address: int, nbytes: int) -> list[Span] | None:
    """Host spans holding ``[address, address + nbytes)`` in the backup of one of ``tags``; None when none holds it."""
    spans = allocator.backups.spans(tags, address, nbytes)
    return None if spans is None else _merged([(host, n) for host, n in spans])


def _merged(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for host, n in spans:
        if out and out[-1][0] + out[-1][1] == host:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((host, n))
    return out


def read_spans(spans: list[Span]) -> bytes:
    """The bytes of ``spans``, in order (a copy)."""
    return b"".join(ctypes.string_at(host, n) for host, n in spans)


def owning_tag(allocator: TaggedAllocator, tags: Iterable[str], address: int, nbytes: int) -> str | None:
    """Which of ``tags`` holds an allocation containing ``[address, address + nbytes)`` (None: none)."""
    for tag in tags:
        for lo, size, _ in allocator.allocations(tag):
            if lo <= address and address + nbytes <= lo + size:
                return tag
    return None


def not_found(address: int, nbytes: int) -> TmsUsageError:
    """The error for a tensor the saver holds no memory of (TMS prints and exits)."""
    msg = (
        f"get_cpu_backup: no region of the saver holds {nbytes} bytes at {address:#x} "
        "(allocate the tensor inside torch_memory_saver.region(...))"
    )
    return TmsUsageError(msg)
