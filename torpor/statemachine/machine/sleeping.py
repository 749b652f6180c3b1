"""The sleep command: guard, plan, check the host budget, back up, release, agree with the group, record.

Anything raised inside (a memory error, a ``KeyboardInterrupt``, a log that
cannot be written) rolls the sleep back through
:func:`~torpor.statemachine.machine.rollback.abort_sleep`, then is raised again.
"""

from __future__ import annotations

import math
import os
import time

from torpor.errors import InvalidLevel, TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.policy import Action
from torpor.statemachine.core.protocol import Doors
from torpor.statemachine.core.states import ASLEEP, State
from torpor.statemachine.machine.base import GiB, logger
from torpor.statemachine.machine.gate import CommandGate
from torpor.statemachine.machine.group import collective
from torpor.statemachine.machine.hostmem import backup_bytes, budget_refusal, device_report, pinned_bytes
from torpor.statemachine.machine.rollback import SleepProgress, abort_sleep
from torpor.statemachine.projection.view import Projection

#: Seconds a sleep waits for the allocation blocks of its tags open in other threads (then refused).
BLOCK_WAIT_ENV = "TORPOR_BLOCK_WAIT"
BLOCK_WAIT_DEFAULT = 10.0


def block_wait() -> float:
    """How long a sleep waits for open allocation blocks: ``TORPOR_BLOCK_WAIT`` seconds (finite, >= 0; default 10)."""
    raw = os.environ.get(BLOCK_WAIT_ENV, "").strip()
    if not raw:
        return BLOCK_WAIT_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        msg = f"{BLOCK_WAIT_ENV}={raw!r} is not a number of seconds (finite, 0 or more)"
        raise ValueError(msg)
    return value


class Sleeping(CommandGate):
    """``sleep(level)``: offload or discard every resident tag the policy plans, all or nothing."""

    @collective("sleep")
    def sleep(self, level: int = 1, *, idempotent: bool = False) -> Projection:
        """Put the engine to sleep at ``level`` (1 or 2); return the resulting projection.

        ``idempotent``: a sleep while already asleep at ``level`` or deeper is a
        no-op recorded as ``command_repeated`` instead of a refusal (what an
        orchestrator that retries on every rank needs; the vLLM backend sets it).
        """
        with self._command("sleep", level=level):
            if type(level) is not int or level not in (1, 2):  # not True, not 1.0
                self._refuse("sleep", InvalidLevel(level))
            if idempotent and self.state in ASLEEP and (self.projection.level or 0) >= level:
                why = f"already asleep at level {self.projection.level} since event #{self.projection.since}"
                return self._repeated("sleep", {"level": level}, why)
            self._guard("sleep")
            return self._sleep(level)

    def _sleep(self, level: int) -> Projection:
        start = time.perf_counter()
        usage = self._resident_usage()
        candidates = [t for t in usage if t not in set(self.projection.asleep_tags())]
        plan = self.policy.plan(level, candidates)
        offload = [t for t, a in plan.items() if a is Action.OFFLOAD]
        over = budget_refusal(self.host_policy, self.projection, backup_bytes(self.memory, offload, usage))
        if over is not None:  # before anything is touched
            self._refuse("sleep", over)
        doors = self.memory if isinstance(self.memory, Doors) else None
        if doors is not None:  # no allocation block of a tag may be open while it goes: wait for them, or refuse
            cause = f"sleep level {level}, event #{self.projection.last_seq + 1} (sleep_requested)"
            try:
                doors.close_doors(list(plan), cause, block_wait())
            except TorporError as exc:
                self._refuse("sleep", exc)
        try:
            return self._sleep_planned(level, plan, usage, start)
        finally:
            if doors is not None:
                doors.open_doors(list(plan))

    def _sleep_planned(self, level: int, plan: dict[str, Action], usage: dict[str, int], start: float) -> Projection:
        offload = [t for t, a in plan.items() if a is Action.OFFLOAD]
        discard = [t for t, a in plan.items() if a is Action.DISCARD]
        self._emit(
            EventKind.SLEEP_REQUESTED,
            level=level,
            plan={t: a.value for t, a in plan.items()},
            usage=usage,
            allocations=self._allocation_counts(),
        )
        progress = SleepProgress(level, plan, start)
        undone = False

        def undo_group(exc: TorporError) -> None:  # another rank failed: roll back here, then raise
            nonlocal undone
            undone = True
            progress.phase = "group"
            abort_sleep(self, progress, exc)

        try:
            self.memory.drop_backup(discard)  # a stale backup must never come back as a discarded tag's content
            backed = self.memory.backup(offload)
            progress.backed_up = offload
            for tag in offload:
                t = backed[tag]
                self._emit(EventKind.TAG_BACKED_UP, tag=tag, bytes=t.bytes, seconds=t.seconds)
            progress.phase = "release"
            for tag in offload + discard:  # offloaded tags first: a failure then loses nothing
                if plan[tag] is Action.DISCARD:  # with a group: every rank agrees before anything is discarded
                    self._group_hold(undo_group)
                progress.failed = tag
                done = self.memory.release([tag])[tag]
                progress.released.append(done)
                progress.failed = None
                self._emit(
                    EventKind.TAG_RELEASED,
                    tag=tag,
                    bytes=done.bytes,
                    action=plan[tag].value,
                    seconds=done.seconds,
                    **done.kept_fields(),
                )
            self._group_hold(undo_group)
            progress.phase = "recording"
            seconds = time.perf_counter() - start
            offloaded = sum(t.bytes for t in progress.released if plan[t.tag] is Action.OFFLOAD)
            discarded = sum(t.bytes for t in progress.released if plan[t.tag] is Action.DISCARD)
            self._emit(
                EventKind.SLEEP_COMPLETED,
                level=level,
                seconds=seconds,
                freed=offloaded + discarded,
                offloaded=offloaded,
                discarded=discarded,
                pinned=pinned_bytes(self.memory),
                host_budget=self.host_policy.budget_bytes,
                device=device_report(self.memory),
            )
        except BaseException as exc:  # an error, an interrupt, a log that cannot be written: roll back, raise
            if undone or self.projection.state is not State.SUSPENDING:  # undone for the group, or the sleep stands
                raise
            abort_sleep(self, progress, exc)
        logger.info(
            "sleep freed %.2f GiB (%.2f GiB to host, %.2f GiB discarded) in %.2f s",
            (offloaded + discarded) / GiB,
            offloaded / GiB,
            discarded / GiB,
            seconds,
        )
        return self.projection
