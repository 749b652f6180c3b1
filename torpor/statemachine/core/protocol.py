"""The memory protocol: what the controller asks of the memory it drives, and what else a memory can do.

The controller owns policy (which tag is offloaded or discarded at which
level); an object meeting :class:`Memory` owns only mechanism. The tagged cuMem
allocator (``torpor.allocator.TaggedAllocator``) and the in-memory
``torpor.testing.FakeMemory`` both implement it. Nothing here imports torch.

:class:`Memory` is five methods. What a memory can do beyond them is a
:class:`Capability` (host backups under a policy, allocation doors, a device
report, the CUDA-graph pool, keeping a module across a discard, ...), each one
the methods of its protocol (:data:`CAPABILITY_PROTOCOLS`). A memory says which
it has once, as a class method ``capabilities()`` returning a set of them (as
vLLM's sleep-mode backend says what it preserves with class methods); one that
says nothing is read by its methods (:func:`capabilities_of`, the one place
that asks). The controller asks once, when it is made (:meth:`Abilities.of`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypedDict, cast, runtime_checkable

from torpor.errors import BadArgumentType


class Kept(TypedDict, total=False):
    """An event's ``kept`` field, present only when tracked ranges were kept (logs stay as they were)."""

    kept: int


class Restored(Kept, total=False):
    """A ``tag_restored`` event's ``kept`` and ``checked`` fields, each present only when not zero."""

    checked: int


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
    checked: int = 0  # a wake from a backup: bytes whose checksums were compared with the sleep's, and matched

    def kept_fields(self) -> Kept:
        """``{"kept": bytes}`` for an event when ranges were kept, else nothing (logs stay as they were)."""
        return {"kept": self.kept} if self.kept else {}

    def restored_fields(self) -> Restored:
        """:meth:`kept_fields`, and ``{"checked": bytes}`` when a wake checked bytes (a ``tag_restored`` event's)."""
        out: Restored = {"kept": self.kept} if self.kept else {}
        if self.checked:
            out["checked"] = self.checked
        return out


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

    Anything more is a :class:`Capability`, said by a class method
    ``capabilities()`` (:func:`capabilities_of`); it is not a member here, so
    a memory written before capabilities existed still meets this protocol.
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
class PinnedReporting(Protocol):
    """:attr:`Capability.PINNED`: a memory that says how many pinned host bytes it holds (sleep and wake record it)."""

    def pinned_bytes(self) -> int:
        """Pinned host bytes held (backups and chunks kept for reuse)."""
        ...


@runtime_checkable
class BackupEstimating(Protocol):
    """:attr:`Capability.BACKUP_ESTIMATE`: a memory that knows the host bytes backups will take (the budget check)."""

    def backup_bytes(self, tags: Sequence[str]) -> Mapping[str, int]:
        """Host bytes the backups of ``tags`` would take."""
        ...


@runtime_checkable
class HostMemory(PinnedReporting, Protocol):
    """:attr:`Capability.HOST`: a memory whose host backups the controller's host-memory policy manages."""

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
    """:attr:`Capability.DOORS`: a memory whose allocation blocks a sleep must close first.

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
    """:attr:`Capability.DEVICE_REPORT`: a memory that says how much device memory is in use, how much its tags'."""

    def device_memory(self) -> DeviceMemory:
        """Device memory now: total, in use, tagged."""
        ...


@runtime_checkable
class GraphPoolMemory(Memory, Protocol):
    """:attr:`Capability.GRAPH_POOL`: a memory that also owns the process's CUDA-graph pool (tag ``cudagraph``)."""

    def cudagraph_pool_holders(self) -> Sequence[str]:
        """Name everything that references the graph pool (empty when free)."""
        ...

    def capture_into_pool(self, site: str) -> AbstractContextManager[object]:
        """Context for capturing one graph into the pool, recorded under ``site``."""
        ...

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool; return the bytes it held."""
        ...


@runtime_checkable
class TrackingMemory(Protocol):
    """:attr:`Capability.TRACK`: a memory that can keep a module's unrestorable state across a discard of its tag."""

    def track(self, module: object, tag: str = "weights", *, check: bool = True) -> object:
        """Keep what no reload of ``module`` restores whenever ``tag`` is released without a backup."""
        ...


class Capability(enum.StrEnum):
    """What a memory can do beyond :class:`Memory`; each is the methods of one protocol (:data:`CAPABILITY_PROTOCOLS`)."""

    HOST = "host"  # configure_host, trim_host, pinned_bytes: the host-memory policy applies
    PINNED = "pinned"  # pinned_bytes: events say the pinned host bytes
    BACKUP_ESTIMATE = "backup_estimate"  # backup_bytes: the budget check uses the memory's own estimate
    DOORS = "doors"  # close_doors, open_doors: a sleep waits for open allocation blocks
    DEVICE_REPORT = "device_report"  # device_memory: sleep_completed says what stays on the device
    GRAPH_POOL = "graph_pool"  # capture and release_cudagraph_pool work
    TRACK = "track"  # track(module) keeps a module whole across a discard


#: The protocol whose methods each capability is.
CAPABILITY_PROTOCOLS: Mapping[Capability, type] = {
    Capability.HOST: HostMemory,
    Capability.PINNED: PinnedReporting,
    Capability.BACKUP_ESTIMATE: BackupEstimating,
    Capability.DOORS: Doors,
    Capability.DEVICE_REPORT: DeviceReporting,
    Capability.GRAPH_POOL: GraphPoolMemory,
    Capability.TRACK: TrackingMemory,
}


def capabilities_of(memory: object) -> frozenset[Capability]:
    """What ``memory`` can do beyond :class:`Memory`: what its class says, else what its methods show.

    Said by a class method ``capabilities()`` (an iterable of :class:`Capability`
    or their names): each capability said must come with its protocol's methods
    (``TypeError`` naming the missing ones otherwise). A memory that says
    nothing (one written before capabilities existed) has each capability whose
    methods it has. :attr:`Capability.HOST` includes :attr:`Capability.PINNED`.
    """
    declare = getattr(type(memory), "capabilities", None)
    if declare is None:
        found = {cap for cap, proto in CAPABILITY_PROTOCOLS.items() if isinstance(memory, proto)}
    else:
        try:
            found = {Capability(c) for c in declare()}
        except ValueError as exc:
            msg = f"{type(memory).__name__}.capabilities() names an unknown capability ({exc}); known: {', '.join(Capability)}"
            raise BadArgumentType(msg) from exc
        lacking = sorted(c.value for c in found if not isinstance(memory, CAPABILITY_PROTOCOLS[c]))
        if lacking:
            msg = (
                f"{type(memory).__name__}.capabilities() says {', '.join(lacking)} but the memory lacks "
                "their methods (torpor.statemachine.core.protocol.CAPABILITY_PROTOCOLS names them)"
            )
            raise BadArgumentType(msg)
    if Capability.HOST in found:
        found.add(Capability.PINNED)
    return frozenset(found)


@dataclass(frozen=True)
class Abilities:
    """A memory seen through its capabilities, asked once: each field is the memory when it has that capability, else None."""

    capabilities: frozenset[Capability]
    host: HostMemory | None = None
    pinned: PinnedReporting | None = None
    estimate: BackupEstimating | None = None
    doors: Doors | None = None
    device: DeviceReporting | None = None
    graphs: GraphPoolMemory | None = None
    tracking: TrackingMemory | None = None

    @classmethod
    def of(cls, memory: object) -> Abilities:
        """``memory``'s abilities (:func:`capabilities_of`; a ``TypeError`` when it says one it lacks)."""
        caps = capabilities_of(memory)

        def having(cap: Capability) -> object:
            return memory if cap in caps else None

        return cls(
            caps,
            host=cast("HostMemory | None", having(Capability.HOST)),
            pinned=cast("PinnedReporting | None", having(Capability.PINNED)),
            estimate=cast("BackupEstimating | None", having(Capability.BACKUP_ESTIMATE)),
            doors=cast("Doors | None", having(Capability.DOORS)),
            device=cast("DeviceReporting | None", having(Capability.DEVICE_REPORT)),
            graphs=cast("GraphPoolMemory | None", having(Capability.GRAPH_POOL)),
            tracking=cast("TrackingMemory | None", having(Capability.TRACK)),
        )
