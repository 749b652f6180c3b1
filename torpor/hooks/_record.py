"""Recording a hook's decision on a controller as a ``hook_decision`` event, when a controller is given."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torpor.statemachine.core.events import Event, EventKind

if TYPE_CHECKING:
    from torpor.statemachine.machine.controller import SleepController


def record_decision(controller: SleepController | None, hook: str, active: bool, detail: str) -> Event | None:
    """Append ``hook_decision`` (``hook``, ``active``, ``detail``) to ``controller``; None without one."""
    if controller is None:
        return None
    return controller.record(EventKind.HOOK_DECISION, hook=hook, active=active, detail=detail)
