"""One payload class per event kind: its fields, their types and defaults are the kind's schema.

Each class declares the fields its kind carries (:mod:`torpor.statemachine.core.fields`
turns them into typed attributes over a read-only mapping). A field without a
default must be present; a field with one is optional, reads as its default when
absent and is written only when given, so logs written before a field existed
still read. Readers check every declared field by its type
(:mod:`torpor.statemachine.log.checks`); :data:`PAYLOADS` maps each kind to its class.
"""

# No ``from __future__ import annotations``: the payload classes read their evaluated annotations.

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any

from torpor.errors import SchemaIncomplete
from torpor.statemachine.core.fields import Payload
from torpor.statemachine.core.kinds import EventKind

# -- the field types (each has one check in torpor.statemachine.log.checks) ---------------

#: Bytes per tag, ``{tag: bytes}``.
Usage = Mapping[str, int]
#: Tag names, or None for "all tags".
Tags = tuple[str, ...] | None
#: What stays on the device while asleep (``total``, ``in_use``, ``tagged``, ``untagged``), or None.
Device = Annotated[Mapping[str, int] | None, "signed byte counts"]
#: Tags the memory holds released: ``{tag: {"host": bytes, "discarded": bytes}}``.
Released = Mapping[str, Mapping[str, int]]
#: A projection's JSON form (:meth:`~torpor.statemachine.projection.view.Projection.to_dict`).
ProjectionForm = Annotated[Mapping[str, Any], "projection"]

_NO_USAGE: Usage = MappingProxyType({})
_NOTHING: Mapping[str, Any] = MappingProxyType({})


# -- one payload class per kind -------------------------------------------------------


class Opened(Payload, kind=EventKind.OPENED):
    """A controller opened: the memory's ``usage``, its class, the state before, the host-memory policy."""

    usage: Usage = _NO_USAGE
    allocations: Usage = _NO_USAGE  # allocations per tag (a count, not bytes); absent in older logs
    memory: str = ""
    previous_state: str | None = None
    host: Mapping[str, Any] | None = None  # pin, after_wake, budget_bytes


class Recovered(Payload, kind=EventKind.RECOVERED):
    """``recover()`` took the memory as it is after an interrupted transition."""

    usage: Usage = _NO_USAGE
    released: Released = _NOTHING
    interrupted_state: str | None = None
    interrupted_step: str | None = None


class SleepRequested(Payload, kind=EventKind.SLEEP_REQUESTED):
    """A sleep began: its level, its plan ``{tag: offload|discard}``, the usage before."""

    level: int
    plan: Mapping[str, str] = _NOTHING
    usage: Usage = _NO_USAGE
    allocations: Usage = _NO_USAGE  # allocations per tag before the sleep (a count)


class TagBackedUp(Payload, kind=EventKind.TAG_BACKED_UP):
    """A tag's content copied to the host (before its release).

    ``seconds``: the backup call's; one call copies every tag a sleep offloads (its copies overlap), so each of
    those tags' events carries the same seconds.
    """

    tag: str
    bytes: int
    seconds: float = 0.0


class TagReleased(Payload, kind=EventKind.TAG_RELEASED):
    """A tag's physical memory released: its content on the host (``offload``) or gone (``discard``)."""

    tag: str
    bytes: int
    action: str = ""
    seconds: float = 0.0
    kept: int = 0  # discarded, yet these bytes (tracked state no reload restores) kept on the host


class SleepCompleted(Payload, kind=EventKind.SLEEP_COMPLETED):
    """A sleep finished; ``incomplete`` says why a failed sleep's rollback left it part done."""

    level: int | None = None
    seconds: float = 0.0
    freed: int = 0
    offloaded: int = 0
    discarded: int = 0
    pinned: int | None = None  # pinned host bytes held after the sleep; None: not said
    host_budget: int | None = None
    device: Device = None
    incomplete: str | None = None


class SleepAborted(Payload, kind=EventKind.SLEEP_ABORTED):
    """A sleep failed and was rolled back; ``lost`` names tags whose content may be gone."""

    level: int | None = None
    reason: str | None = None
    error: str | None = None
    seconds: float = 0.0
    usage: Usage = _NO_USAGE
    lost: tuple[str, ...] = ()


class WakeRequested(Payload, kind=EventKind.WAKE_REQUESTED):
    """A wake began: the tags asked for (None: all) and those to restore."""

    tags: Tags = None
    restoring: Tags = None


class TagRestored(Payload, kind=EventKind.TAG_RESTORED):
    """A tag mapped back: from the ``host`` backup, ``fresh`` memory, or by a sleep's ``rollback`` (``lost``)."""

    tag: str
    bytes: int
    source: str = ""
    seconds: float = 0.0
    lost: bool = False
    kept: int = 0  # of a ``fresh`` tag: bytes of tracked state copied back from the host
    checked: int = 0  # of a ``host`` tag: bytes whose checksums matched the sleep's (every wake is checked)


class TagRolledBack(Payload, kind=EventKind.TAG_ROLLED_BACK):
    """A failed wake released a tag it had mapped again (``action`` as in ``tag_released``)."""

    tag: str
    bytes: int
    action: str = ""


class WakeCompleted(Payload, kind=EventKind.WAKE_COMPLETED):
    """A wake finished; ``host_released``: pinned bytes given back by the host-memory policy."""

    tags: Tags = None
    seconds: float = 0.0
    restored: int = 0
    pinned: int | None = None
    host_released: int = 0
    usage: Usage | None = None


class WakeFailed(Payload, kind=EventKind.WAKE_FAILED):
    """A wake failed and was rolled back to asleep."""

    tags: Tags = None
    reason: str | None = None
    error: str | None = None
    seconds: float = 0.0


class TagDiscarded(Payload, kind=EventKind.TAG_DISCARDED):
    """A host backup dropped while asleep."""

    tag: str
    bytes: int


class DiscardCompleted(Payload, kind=EventKind.DISCARD_COMPLETED):
    """A discard ended: the resident tags released without backup; ``error``/``reason`` when part done."""

    tags: Tags = None
    reason: str | None = None
    error: str | None = None
    seconds: float = 0.0


class Refused(Payload, kind=EventKind.REFUSED):
    """A command refused: why, the error class, who holds what, the state it was refused in."""

    command: str = ""
    reason: str | None = None
    error: str | None = None
    holders: tuple[str, ...] = ()
    state: str = ""


class PoolCreated(Payload, kind=EventKind.POOL_CREATED):
    """A CUDA-graph memory pool created."""

    pool: str


class GraphCaptured(Payload, kind=EventKind.GRAPH_CAPTURED):
    """A CUDA graph captured at ``site`` into ``pool``."""

    site: str
    pool: str
    seconds: float = 0.0
    usage: Usage | None = None


class PoolReleased(Payload, kind=EventKind.POOL_RELEASED):
    """The graph pool and its graphs released."""

    pool: str | None = None
    bytes: int = 0
    usage: Usage | None = None


class UsageObserved(Payload, kind=EventKind.USAGE_OBSERVED):
    """The memory's resident bytes per tag, observed, and its allocations per tag (a count)."""

    usage: Usage
    allocations: Usage = _NO_USAGE


class HookDecision(Payload, kind=EventKind.HOOK_DECISION):
    """A hook's decision (graph-pool routing, all-reduce, NCCL), recorded from outside."""

    hook: str = ""
    active: bool = False
    detail: str = ""


class Snapshot(Payload, kind=EventKind.SNAPSHOT):
    """The projection at a log rotation: replay starts from here when older segments are gone."""

    projection: ProjectionForm


class Closed(Payload, kind=EventKind.CLOSED):
    """The controller closed, in ``state``."""

    state: str = ""


class CommandRepeated(Payload, kind=EventKind.COMMAND_REPEATED):
    """A retried command whose effect already holds, accepted as a no-op (``idempotent=True``)."""

    command: str = ""
    args: Mapping[str, Any] = _NOTHING
    state: str = ""
    reason: str | None = None


class GroupAgreed(Payload, kind=EventKind.GROUP_AGREED):
    """A TP group's outcome: ``commit`` or ``rollback``, who failed and why, this rank's own vote."""

    group: str
    command: str
    round: int
    size: int
    result: str
    failed: Mapping[str, str] = _NOTHING
    voted: bool = True
    seconds: float = 0.0


class BackupAdopted(Payload, kind=EventKind.BACKUP_ADOPTED):
    """A new process took a dead one's host backup from a keeper (``torpor.keeper``): which, whose, how much, how fast."""

    keeper: str = ""
    engine: str = ""
    backup: str = ""
    from_pid: int = 0
    bytes: int = 0
    tensors: int = 0
    seconds: float = 0.0


#: The payload class of each kind.
PAYLOADS: Mapping[EventKind, type[Payload]] = MappingProxyType(
    {EventKind(cls.kind): cls for cls in Payload.__subclasses__()}
)
if set(PAYLOADS) != set(EventKind):  # a kind without a class would make every reader fail
    _msg = f"event kinds without a payload class: {sorted(set(EventKind) - set(PAYLOADS))}"
    raise SchemaIncomplete(_msg)


__all__ = [
    "PAYLOADS",
    "BackupAdopted",
    "Closed",
    "CommandRepeated",
    "Device",
    "DiscardCompleted",
    "GraphCaptured",
    "GroupAgreed",
    "HookDecision",
    "Opened",
    "PoolCreated",
    "PoolReleased",
    "ProjectionForm",
    "Recovered",
    "Refused",
    "Released",
    "SleepAborted",
    "SleepCompleted",
    "SleepRequested",
    "Snapshot",
    "TagBackedUp",
    "TagDiscarded",
    "TagReleased",
    "TagRestored",
    "TagRolledBack",
    "Tags",
    "Usage",
    "UsageObserved",
    "WakeCompleted",
    "WakeFailed",
    "WakeRequested",
]
