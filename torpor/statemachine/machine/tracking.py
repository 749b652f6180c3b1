"""The controller's ``track``: keep a module whole across the discards its policy plans (level 2 of ``weights``).

A discard loses a tag's content and the engine reloads what a ``state_dict``
holds; what it does not hold (non-persistent buffers such as rotary
``inv_freq``, tensors kept as plain attributes) must survive the discard. The
policy decides when a tag is discarded; :meth:`Tracking.track` says which
module lives in the tag, and the memory (mechanism:
``torpor.allocator.keep.keeping``) keeps that module's unrestorable ranges on the host
whenever it releases the tag without a backup, and copies them back at the
wake. The bytes kept are recorded as ``kept`` on ``tag_released`` and
``tag_restored``. Nothing here imports torch: the memory finds the ranges.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torpor.errors import TrackRefused
from torpor.statemachine.core.policy import WEIGHTS, Action
from torpor.statemachine.machine.base import ControllerBase, logger


@runtime_checkable
class TrackingMemory(Protocol):
    """A memory that can keep a module's unrestorable state across a discard of its tag."""

    def track(self, module: object, tag: str = WEIGHTS, *, check: bool = True) -> object:
        """Keep what no reload of ``module`` restores whenever ``tag`` is released without a backup."""
        ...


class Tracking(ControllerBase):
    """``track(module, tag)``: the entry point; the memory does the keeping."""

    def track(self, module: object, tag: str = WEIGHTS, *, check: bool = True) -> object:
        """Keep ``module``'s state that no ``state_dict`` reload restores across each discard of ``tag``.

        ``module``: a ``torch.nn.Module`` whose parameters live in ``tag``
        (built inside ``use_memory_pool(tag)``), or any keep source of the
        memory's. Returns the memory's tracker; for a module its
        ``check_reloaded()`` raises ``NotReloaded`` naming each parameter or
        persistent buffer the reload left unwritten after a wake without a
        backup (``check``: the wake fills them with 0xFF first), and
        ``untrack()`` stops keeping it. Refused (``TrackRefused``) when the
        memory cannot keep ranges or the policy never discards ``tag``.
        """
        if not isinstance(self.memory, TrackingMemory):
            msg = f"cannot track a module in {tag!r}: {type(self.memory).__name__} cannot keep ranges across a discard"
            raise TrackRefused(msg)
        discarded = [lv for lv in sorted(self.policy.levels) if self.policy.plan(lv, [tag])[tag] is Action.DISCARD]
        if not discarded and tag not in self.policy.deferrable:
            msg = (
                f"cannot track a module in {tag!r}: the policy never discards it (offloaded at every level), "
                "so every byte comes back from its backup"
            )
            raise TrackRefused(msg)
        tracker = self.memory.track(module, tag, check=check)
        logger.info("tracking %s in %r: kept across its discard (levels %s)", type(module).__name__, tag, discarded)
        return tracker
