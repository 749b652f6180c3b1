"""The kinds of event: every fact the controller records, by name, and which of them end a transition."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

SCHEMA_VERSION = 1


class EventKind(enum.StrEnum):
    """Every kind of fact the controller records; each has one payload class (:data:`PAYLOADS`)."""

    OPENED = "opened"
    RECOVERED = "recovered"
    SLEEP_REQUESTED = "sleep_requested"
    TAG_BACKED_UP = "tag_backed_up"
    TAG_RELEASED = "tag_released"
    SLEEP_COMPLETED = "sleep_completed"
    SLEEP_ABORTED = "sleep_aborted"
    WAKE_REQUESTED = "wake_requested"
    TAG_RESTORED = "tag_restored"
    TAG_ROLLED_BACK = "tag_rolled_back"
    WAKE_COMPLETED = "wake_completed"
    WAKE_FAILED = "wake_failed"
    TAG_DISCARDED = "tag_discarded"
    DISCARD_COMPLETED = "discard_completed"
    REFUSED = "refused"
    POOL_CREATED = "pool_created"
    GRAPH_CAPTURED = "graph_captured"
    POOL_RELEASED = "pool_released"
    USAGE_OBSERVED = "usage_observed"
    HOOK_DECISION = "hook_decision"
    SNAPSHOT = "snapshot"
    CLOSED = "closed"
    COMMAND_REPEATED = "command_repeated"
    GROUP_AGREED = "group_agreed"
    BACKUP_ADOPTED = "backup_adopted"


#: Kinds that end (or begin) a transition: the log makes them durable.
BOUNDARY_KINDS: frozenset[EventKind] = frozenset(
    {
        EventKind.OPENED,
        EventKind.RECOVERED,
        EventKind.SLEEP_REQUESTED,
        EventKind.SLEEP_COMPLETED,
        EventKind.SLEEP_ABORTED,
        EventKind.WAKE_REQUESTED,
        EventKind.WAKE_COMPLETED,
        EventKind.WAKE_FAILED,
        EventKind.DISCARD_COMPLETED,
        EventKind.SNAPSHOT,
        EventKind.CLOSED,
        EventKind.GROUP_AGREED,
    }
)


#: Each kind by its name (a dict lookup: faster than ``EventKind(name)``).
KIND_NAMED: Mapping[str, EventKind] = MappingProxyType({k.value: k for k in EventKind})

__all__ = ["BOUNDARY_KINDS", "KIND_NAMED", "SCHEMA_VERSION", "EventKind"]
