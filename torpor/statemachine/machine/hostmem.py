"""The controller's side of host memory and device reporting: apply the host-memory policy, check its budget, report what stays.

The allocator only obeys (pin ahead or not, a byte limit, trim when told); the
decisions are here, next to the controller that takes them. Every function
works on any :class:`~torpor.statemachine.core.protocol.Memory`: a memory without
host backups (:class:`HostMemory`) or device reporting (:class:`DeviceReporting`)
is left alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from torpor.errors import HostBudgetExceeded
from torpor.statemachine.core.policy import AfterWake, HostMemoryPolicy, PinWhen
from torpor.statemachine.core.protocol import DeviceReporting, HostMemory, Memory
from torpor.statemachine.projection.view import Projection


def apply_host_policy(memory: Memory, host: HostMemoryPolicy, never_backed_up: AbstractSet[str] = frozenset()) -> None:
    """Tell the memory whether to pin ahead, for which tags not (``never_backed_up``), and how many pinned bytes it may hold."""
    if isinstance(memory, HostMemory):
        memory.configure_host(
            prepin=host.pin is PinWhen.AHEAD,
            limit_bytes=host.budget_bytes,
            prepin_exclude=frozenset(never_backed_up),
        )


def backup_bytes(memory: Memory, tags: Iterable[str], resident: Mapping[str, int]) -> dict[str, int]:
    """Host bytes the backups of ``tags`` need: the memory's own estimate when it has one, else their resident bytes."""
    tags = list(tags)
    estimate = getattr(memory, "backup_bytes", None)
    if callable(estimate):
        return {t: int(n) for t, n in dict(estimate(tags)).items()}
    return {t: int(resident.get(t, 0)) for t in tags}


def budget_refusal(
    host: HostMemoryPolicy, projection: Projection, offloading: Mapping[str, int], command: str = "sleep"
) -> HostBudgetExceeded | None:
    """The refusal a sleep gets when its backups and those held already would pass the budget; None when they fit."""
    if host.budget_bytes is None:
        return None
    held = {t: u.host for t, u in projection.residency.items() if t in projection.asleep and u.host}
    if sum(held.values()) + sum(offloading.values()) <= host.budget_bytes:
        return None
    return HostBudgetExceeded(command, projection.state.value, dict(offloading), held, host.budget_bytes)


def release_unused_host(memory: Memory, host: HostMemoryPolicy) -> int:
    """In ``release`` mode, give back pinned host memory no backup uses (in the background); return its bytes.

    Called after a wake, a discard that dropped backups, and an aborted sleep:
    host memory is then held only by backups of tags that are asleep.
    """
    if host.after_wake is AfterWake.RELEASE and isinstance(memory, HostMemory):
        return int(memory.trim_host(True))
    return 0


def device_report(memory: Memory) -> dict[str, Any] | None:
    """Device memory now, as an event field: total, in use, torpor's tagged bytes and the untagged rest."""
    if not isinstance(memory, DeviceReporting):
        return None
    try:
        dev = memory.device_memory()
    except Exception:  # a report must never fail a sleep
        return None
    return {"total": dev.total, "in_use": dev.in_use, "tagged": dev.tagged, "untagged": dev.untagged}


def pinned_bytes(memory: Memory) -> int:
    """Pinned host bytes the memory holds now, as an event field; 0 for a memory that does not say."""
    pinned = getattr(memory, "pinned_bytes", None)
    return int(pinned()) if callable(pinned) else 0
