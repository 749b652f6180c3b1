"""The controller's side of host memory and device reporting: apply the host-memory policy, check its budget, report what stays.

The allocator only obeys (pin ahead or not, a byte limit, trim when told); the
decisions are here, next to the controller that takes them. :class:`HostSide`
works on any memory through its :class:`~torpor.statemachine.core.protocol.Abilities`,
asked once: a memory without host backups (``Capability.HOST``), a pinned-bytes
count, a backup estimate or device reporting is left alone on that count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from torpor.errors import HostBudgetExceeded
from torpor.statemachine.core.policy import AfterWake, HostMemoryPolicy, PinWhen
from torpor.statemachine.core.protocol import Abilities
from torpor.statemachine.projection.view import Projection


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


class HostSide:
    """The host-memory policy of one controller, over the memory's abilities."""

    def __init__(self, abilities: Abilities, policy: HostMemoryPolicy) -> None:
        self.policy = policy
        self._abilities = abilities

    def apply(self, never_backed_up: AbstractSet[str] = frozenset()) -> None:
        """Tell the memory whether to pin ahead, for which tags not (``never_backed_up``), and how many pinned bytes it may hold."""
        host = self._abilities.host
        if host is not None:
            host.configure_host(
                prepin=self.policy.pin is PinWhen.AHEAD,
                limit_bytes=self.policy.budget_bytes,
                prepin_exclude=frozenset(never_backed_up),
            )

    def backup_bytes(self, tags: Iterable[str], resident: Mapping[str, int]) -> dict[str, int]:
        """Host bytes the backups of ``tags`` need: the memory's own estimate when it has one, else their resident bytes."""
        tags = list(tags)
        estimate = self._abilities.estimate
        if estimate is not None:
            return {t: int(n) for t, n in dict(estimate.backup_bytes(tags)).items()}
        return {t: int(resident.get(t, 0)) for t in tags}

    def refusal(self, projection: Projection, offloading: Mapping[str, int]) -> HostBudgetExceeded | None:
        """:func:`budget_refusal` for a sleep under this policy."""
        return budget_refusal(self.policy, projection, offloading)

    def release_unused(self) -> int:
        """In ``release`` mode, give back pinned host memory no backup uses (in the background); return its bytes.

        Called after a wake, a discard that dropped backups, and an aborted sleep:
        host memory is then held only by backups of tags that are asleep.
        """
        host = self._abilities.host
        if self.policy.after_wake is AfterWake.RELEASE and host is not None:
            return int(host.trim_host(True))
        return 0

    def device_report(self) -> dict[str, Any] | None:
        """Device memory now, as an event field: total, in use, torpor's tagged bytes and the untagged rest."""
        device = self._abilities.device
        if device is None:
            return None
        try:
            dev = device.device_memory()
        except Exception:  # a report must never fail a sleep
            return None
        return {"total": dev.total, "in_use": dev.in_use, "tagged": dev.tagged, "untagged": dev.untagged}

    def pinned(self) -> int:
        """Pinned host bytes the memory holds now, as an event field; 0 for a memory that does not say."""
        pinned = self._abilities.pinned
        return int(pinned.pinned_bytes()) if pinned is not None else 0
