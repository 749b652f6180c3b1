"""The wake step: restore the tags asked for (and every tag any wake restores), agree with the group, record.

A wake that fails releases again what it mapped through
:func:`~torpor.statemachine.machine.rollback.fail_wake` (the backups are kept until
the wake completes), then raises the error again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from torpor.errors import LogWriteFailed, NoTagsNamed, TorporError
from torpor.statemachine.core.events import TagRestored, WakeCompleted, WakeRequested
from torpor.statemachine.core.states import State
from torpor.statemachine.machine.context import Context, _tag_list
from torpor.statemachine.machine.rollback import WakeProgress, fail_wake
from torpor.statemachine.projection.view import Projection

logger = logging.getLogger("torpor")


def wake(ctx: Context, tags: Sequence[str] | str | None, idempotent: bool) -> Projection:
    """``wake(tags)`` inside the gate: the tags checked, an idempotent repeat, the guard, then :func:`restore`."""
    wanted = None if tags is None else _tag_list(tags)
    projection = ctx.projection
    if wanted == []:  # no tag at all: an empty filter upstream, never "wake nothing" (None wakes all)
        asleep = projection.asleep_tags()
        ctx.gate.refuse("wake", NoTagsNamed("wake", projection.state.value, projection.since, asleep))
    if idempotent and projection.state in (State.AWAKE, State.PARTIALLY_AWAKE):
        if wanted is not None:
            ctx.check_tags("wake", wanted)
        if not ctx.policy.wake_set(wanted, projection.asleep_tags()):
            return ctx.gate.repeated("wake", {"tags": wanted}, f"every tag asked for is resident ({projection.state})")
    ctx.gate.guard("wake")
    return restore(ctx, wanted)


def restore(ctx: Context, tags: list[str] | None) -> Projection:
    """Map ``tags`` (None: all) and every tag any wake restores back, all or nothing; record the wake."""
    start = time.perf_counter()
    if tags is not None:
        ctx.check_tags("wake", tags)
    restoring = ctx.policy.wake_set(tags, ctx.projection.asleep_tags())
    ctx.recorder.record(WakeRequested(tags=None if tags is None else tuple(tags), restoring=tuple(restoring)))
    progress = WakeProgress(tags, start)
    undone = False
    memory = ctx.memory

    def undo_group(exc: TorporError) -> None:  # another rank failed: roll back here, then raise
        nonlocal undone
        undone = True
        fail_wake(ctx, progress, exc)

    try:
        for tag in restoring:
            source = "host" if ctx.projection.residency[tag].host else "fresh"
            done = memory.restore([tag])[tag]
            progress.restored.append((tag, done, source))
            ctx.recorder.record(
                TagRestored(tag=tag, bytes=done.bytes, source=source, seconds=done.seconds, **done.restored_fields())
            )
        ctx.hold(undo_group)  # backups kept until the group agrees
    except BaseException as exc:  # an error, an interrupt, a log that cannot be written: roll back, raise
        if undone:  # the group's rollback ran already
            raise
        fail_wake(ctx, progress, exc)
    interrupt: BaseException | None = None
    try:
        memory.drop_backup([t for t, _, _ in progress.restored])
    except Exception:
        logger.exception("dropping backups after a wake failed; the wake itself succeeded")
    except BaseException as exc:  # an interrupt here: every tag is back, the wake stands; raised once recorded
        interrupt = exc
    host_released = ctx.host.release_unused()
    seconds = time.perf_counter() - start
    try:
        ctx.recorder.record(
            WakeCompleted(
                tags=None if tags is None else tuple(tags),
                seconds=seconds,
                restored=sum(t.bytes for _, t, _ in progress.restored),
                pinned=ctx.host.pinned(),
                host_released=host_released,
            )
        )
    except LogWriteFailed as exc:  # every tag is back and its backup gone: nothing to roll back to
        ctx.gate.needs_recover(f"the end of a wake could not be recorded ({exc}); every tag asked for is resident")
        raise
    if interrupt is not None:
        raise interrupt
    return ctx.projection
