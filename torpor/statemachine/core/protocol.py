"""The memory protocol: what the controller asks of the memory it drives.

The controller owns policy (which tag is offloaded or discarded at which
level); an object meeting :class:`Memory` owns only mechanism. The tagged cuMem
allocator (``torpor.allocator.TaggedAllocator``) and the in-memory
``torpor.testing.FakeMemory`` both implement it. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class TagUsage:
    """Bytes of one tag by residency, and how many allocations it has."""

    resident: int = 0
    host: int = 0
    discarded: int = 0
    allocations: int = 0


@dataclass(frozen=True)
class Transfer:
    """What one memory step did to one tag: bytes moved and seconds spent."""

    tag: str
    bytes: int
    seconds: float
    offloaded: bool = False
    kept: int = 0  # a tag released or restored without a backup: bytes of tracked ranges kept on the host

    def kept_fields(self) -> dict[str, int]:
        """``{"kept": bytes}`` for an event when ranges were kept, else nothing (logs stay as they were)."""
        return {"kept": self.kept} if self.kept else {}


@dataclass(frozen=True)
class DeviceMemory:
    """Device memory on the devices a memory uses: ``total``, ``in_use`` by anyone, ``tagged`` (mapped by torpor's tags).

    ``untagged`` is the rest of what is in use: the CUDA context, libraries'
    workspaces (cuBLAS, NCCL), torch's default pool, other processes on the GPU.
    """

    total: int
    in_use: int
    tagged: int

    @property
    def untagged(self) -> int:
        """In use, not torpor's tags."""
        return max(self.in_use - self.tagged, 0)


@runtime_checkable
class Memory(Protocol):
    """Mechanism the :class:`~torpor.SleepController` drives.

    Sleep first drops any stale backup of the tags it will discard
    (:meth:`drop_backup`), then is two-phase: :meth:`backup` for every offloaded tag (all or nothing:
    on failure it drops what it backed up in this call and raises a
    ``TorporError``), then :meth:`release` for every tag (physical memory goes;
    a tag with a backup keeps it, a tag without one is discarded). Wake calls
    :meth:`restore`, which maps memory back at the same addresses and copies
    the backup in when there is one; on failure it unmaps what it mapped in
    that call, keeps every backup, and raises.
    """

    def usage(self) -> Mapping[str, TagUsage]:
        """Current bytes per tag."""
        ...

    def backup(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        """Copy each tag's resident memory to host memory (phase 1 of sleep)."""
        ...

    def release(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        """Release each tag's physical memory (phase 2 of sleep)."""
        ...

    def restore(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        """Map each tag back at its addresses and copy its backup in."""
        ...

    def drop_backup(self, tags: Sequence[str]) -> None:
        """Forget the backups of resident tags (after an aborted sleep)."""
        ...


@runtime_checkable
class HostMemory(Protocol):
    """A memory whose host backups the controller's host-memory policy manages (optional to :class:`Memory`)."""

    def pinned_bytes(self) -> int:
        """Pinned host bytes held (backups and chunks kept for reuse)."""
        ...

    def configure_host(
        self, *, prepin: bool, limit_bytes: int | None, prepin_exclude: frozenset[str] = frozenset()
    ) -> None:
        """Pin ahead or not (never for the tags in ``prepin_exclude``), and the most pinned bytes held."""
        ...

    def trim_host(self, background: bool = False) -> int:
        """Unpin what holds no backup; return the bytes given back."""
        ...


@runtime_checkable
class Doors(Protocol):
    """A memory whose allocation blocks a sleep must close first (optional to :class:`Memory`).

    :meth:`close_doors` refuses new blocks of the tags and waits, bounded, for the
    open ones (raising a ``TorporError`` that names them, with nothing touched);
    :meth:`open_doors` undoes it once the sleep ended, done or rolled back.
    """

    def close_doors(self, tags: Sequence[str], cause: str, timeout: float) -> None:
        """Refuse new blocks of ``tags``; wait up to ``timeout`` s for the open ones to end."""
        ...

    def open_doors(self, tags: Sequence[str]) -> None:
        """Let blocks of ``tags`` start again wherever the tag is awake."""
        ...


@runtime_checkable
class DeviceReporting(Protocol):
    """A memory that can say how much device memory is in use and how much of it is its tags'."""

    def device_memory(self) -> DeviceMemory:
        """Device memory now: total, in use, tagged."""
        ...


@runtime_checkable
class GraphPoolMemory(Memory, Protocol):
    """A memory that also owns the process's CUDA-graph pool (tag ``cudagraph``)."""

    def cudagraph_pool_holders(self) -> Sequence[str]:
        """Name everything that references the graph pool (empty when free)."""
        ...

    def capture_into_pool(self, site: str) -> AbstractContextManager[object]:
        """Context for capturing one graph into the pool, recorded under ``site``."""
        ...

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool; return the bytes it held."""
        ...


def iter_tags(usage: Mapping[str, TagUsage]) -> Iterator[str]:
    """Tags in a stable order (sorted), for plans and events."""
    return iter(sorted(usage))
