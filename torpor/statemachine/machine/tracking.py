"""The controller's ``track``: keep a module whole across the discards its policy plans (level 2 of ``weights``).

A discard loses a tag's content and the engine reloads what a ``state_dict``
holds; what it does not hold (non-persistent buffers such as rotary
``inv_freq``, tensors kept as plain attributes) must survive the discard. The
policy decides when a tag is discarded; :func:`track` says which
module lives in the tag, and the memory (mechanism:
``torpor.allocator.kept_ranges.keeping``) keeps that module's unrestorable ranges on the host
whenever it releases the tag without a backup, and copies them back at the
wake. The bytes kept are recorded as ``kept`` on ``tag_released`` and
``tag_restored``. Nothing here imports torch: the memory finds the ranges.
"""

from __future__ import annotations

import logging

from torpor.errors import TrackRefused
from torpor.statemachine.core.policy import WEIGHTS, Action
from torpor.statemachine.machine.context import Context

logger = logging.getLogger("torpor")

__all__ = ["TrackRefused", "track"]  # TrackRefused: torpor's lazy export names this module


def track(ctx: Context, module: object, tag: str = WEIGHTS, *, check: bool = True) -> object:
    """Keep ``module``'s unrestorable state across each discard of ``tag`` (``SleepController.track``); the memory's tracker."""
    memory = ctx.abilities.tracking
    if memory is None:
        msg = f"cannot track a module in {tag!r}: {type(ctx.memory).__name__} cannot keep ranges across a discard"
        raise TrackRefused(msg)
    policy = ctx.policy
    discarded = [lv for lv in sorted(policy.levels) if policy.plan(lv, [tag])[tag] is Action.DISCARD]
    if not discarded and tag not in policy.deferrable:
        msg = (
            f"cannot track a module in {tag!r}: the policy never discards it (offloaded at every level), "
            "so every byte comes back from its backup"
        )
        raise TrackRefused(msg)
    tracker = memory.track(module, tag, check=check)
    logger.info("tracking %s in %r: kept across its discard (levels %s)", type(module).__name__, tag, discarded)
    return tracker
