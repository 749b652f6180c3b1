"""The sleep step: check, guard, plan, check the host budget, back up, release, agree with the group, record.

Anything raised inside (a memory error, a ``KeyboardInterrupt``, a log that
cannot be written) rolls the sleep back through
:func:`~torpor.statemachine.machine.rollback.abort_sleep`, then is raised again
(see docs/architecture.md "Invariant: a failed command is undone newest first").
"""

from __future__ import annotations

import logging
import time

from torpor.errors import InvalidLevel, TorporError
from torpor.statemachine.core.events import SleepCompleted, SleepRequested, TagBackedUp, TagReleased
from torpor.statemachine.core.policy import Action
from torpor.statemachine.core.states import ASLEEP, State
from torpor.statemachine.machine.context import Context
from torpor.statemachine.machine.rollback import SleepPhase, SleepProgress, abort_sleep
from torpor.statemachine.projection.view import Projection
from torpor.switches import env_seconds
from torpor.units import GiB

logger = logging.getLogger("torpor")

#: Seconds a sleep waits for the allocation blocks of its tags open in other threads (then refused).
BLOCK_WAIT_ENV = "TORPOR_BLOCK_WAIT"
BLOCK_WAIT_DEFAULT = 10.0


def block_wait() -> float:
    """How long a sleep waits for open allocation blocks: ``TORPOR_BLOCK_WAIT`` seconds (finite, >= 0; default 10)."""
    return env_seconds(BLOCK_WAIT_ENV, default=BLOCK_WAIT_DEFAULT)


def sleep(ctx: Context, level: int, idempotent: bool) -> Projection:
    """``sleep(level)`` inside the gate: the level checked, an idempotent repeat, the guard, then the sleep."""
    if type(level) is not int or level not in (1, 2):  # not True, not 1.0
        ctx.gate.refuse("sleep", InvalidLevel(level))
    projection = ctx.projection
    if idempotent and projection.state in ASLEEP and (projection.level or 0) >= level:
        why = f"already asleep at level {projection.level} since event #{projection.since}"
        return ctx.gate.repeated("sleep", {"level": level}, why)
    ctx.gate.guard("sleep")
    start = time.perf_counter()
    usage = ctx.resident_usage()
    candidates = [t for t in usage if t not in set(projection.asleep_tags())]
    plan = ctx.policy.plan(level, candidates)
    offload = [t for t, a in plan.items() if a is Action.OFFLOAD]
    over = ctx.host.refusal(projection, ctx.host.backup_bytes(offload, usage))
    if over is not None:  # before anything is touched
        ctx.gate.refuse("sleep", over)
    doors = ctx.abilities.doors
    if doors is not None:  # no allocation block of a tag may be open while it goes: wait for them, or refuse
        cause = f"sleep level {level}, event #{projection.last_seq + 1} (sleep_requested)"
        try:
            doors.close_doors(list(plan), cause, block_wait())
        except TorporError as exc:
            ctx.gate.refuse("sleep", exc)
    try:
        return _sleep_planned(ctx, level, plan, usage, start)
    finally:
        if doors is not None:
            doors.open_doors(list(plan))


def _sleep_planned(
    ctx: Context, level: int, plan: dict[str, Action], usage: dict[str, int], start: float
) -> Projection:
    offload = [t for t, a in plan.items() if a is Action.OFFLOAD]
    discard = [t for t, a in plan.items() if a is Action.DISCARD]
    ctx.recorder.record(
        SleepRequested(
            level=level,
            plan={t: a.value for t, a in plan.items()},
            usage=usage,
            allocations=ctx.allocation_counts(),
        )
    )
    progress = SleepProgress(level, plan, start)
    undone = False
    memory = ctx.memory

    def undo_group(exc: TorporError) -> None:  # another rank failed: roll back here, then raise
        nonlocal undone
        undone = True
        progress.phase = SleepPhase.GROUP
        abort_sleep(ctx, progress, exc)

    def release(tags: list[str]) -> None:
        progress.phase = SleepPhase.RELEASE
        for tag in tags:
            if plan[tag] is Action.DISCARD:  # with a group: every rank agrees before anything is discarded
                ctx.hold(undo_group)
            progress.failed = tag
            done = memory.release([tag])[tag]
            progress.released.append(done)
            progress.failed = None
            ctx.recorder.record(
                TagReleased(
                    tag=tag, bytes=done.bytes, action=plan[tag].value, seconds=done.seconds, **done.kept_fields()
                )
            )

    # Offloaded tags first (a failure then loses nothing), unless the policy says the discarded content is
    # forgotten already: then it goes first and the driver's work on its memory runs under the copies.
    first = discard if ctx.policy.discard_first and ctx.group is None else []
    try:
        memory.drop_backup(discard)  # a stale backup must never come back as a discarded tag's content
        release(first)
        progress.phase = SleepPhase.BACKUP
        backed = memory.backup(offload)
        progress.backed_up = offload
        for tag in offload:
            t = backed[tag]
            ctx.recorder.record(TagBackedUp(tag=tag, bytes=t.bytes, seconds=t.seconds))
        release(offload + [t for t in discard if t not in first])
        ctx.hold(undo_group)
        progress.phase = SleepPhase.RECORDING
        seconds = time.perf_counter() - start
        offloaded = sum(t.bytes for t in progress.released if plan[t.tag] is Action.OFFLOAD)
        discarded = sum(t.bytes for t in progress.released if plan[t.tag] is Action.DISCARD)
        ctx.recorder.record(
            SleepCompleted(
                level=level,
                seconds=seconds,
                freed=offloaded + discarded,
                offloaded=offloaded,
                discarded=discarded,
                pinned=ctx.host.pinned(),
                host_budget=ctx.host.policy.budget_bytes,
                device=ctx.host.device_report(),
            )
        )
    except BaseException as exc:  # an error, an interrupt, a log that cannot be written: roll back, raise
        if undone or ctx.state is not State.SUSPENDING:  # undone for the group, or the sleep stands
            raise
        abort_sleep(ctx, progress, exc)
    logger.info(
        "sleep freed %.2f GiB (%.2f GiB to host, %.2f GiB discarded) in %.2f s",
        (offloaded + discarded) / GiB,
        offloaded / GiB,
        discarded / GiB,
        seconds,
    )
    return ctx.projection
