"""The wake command: restore the tags asked for (and every tag any wake restores), agree with the group, record.

A wake that fails releases again what it mapped through
:func:`~torpor.statemachine.machine.rollback.fail_wake` (the backups are kept until
the wake completes), then raises the error again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torpor.errors import LogWriteFailed, NoTagsNamed, TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.states import State
from torpor.statemachine.machine.base import _tag_list, logger
from torpor.statemachine.machine.gate import CommandGate
from torpor.statemachine.machine.group import collective
from torpor.statemachine.machine.hostmem import pinned_bytes, release_unused_host
from torpor.statemachine.machine.rollback import WakeProgress, fail_wake
from torpor.statemachine.projection.view import Projection


class Waking(CommandGate):
    """``wake(tags)``: map asleep tags back at their addresses, all or nothing."""

    @collective("wake")
    def wake(self, tags: Sequence[str] | str | None = None, *, idempotent: bool = False) -> Projection:
        """Wake ``tags`` (None: all); every non-deferrable tag is restored by any wake.

        An empty list names no tag and is refused (``NoTagsNamed``, recorded as
        ``refused``) in every state: it is most often a filter upstream that came
        out empty, and waking only the tags every wake restores would leave the
        engine ``partially_awake`` with nothing it asked for.

        ``idempotent``: a wake that would restore nothing (every tag asked for,
        and every tag any wake restores, is resident) is a no-op recorded as
        ``command_repeated`` instead of a refusal; unknown tags are still refused.
        """
        with self._command("wake", tags=tags):
            wanted = None if tags is None else _tag_list(tags)
            if wanted == []:  # no tag at all: an empty filter upstream, never "wake nothing" (None wakes all)
                asleep = self.projection.asleep_tags()
                self._refuse("wake", NoTagsNamed("wake", self.state.value, self.projection.since, asleep))
            if idempotent and self.state in (State.AWAKE, State.PARTIALLY_AWAKE):
                if wanted is not None:
                    self._check_tags("wake", wanted)
                if not self.policy.wake_set(wanted, self.projection.asleep_tags()):
                    return self._repeated("wake", {"tags": wanted}, f"every tag asked for is resident ({self.state})")
            self._guard("wake")
            return self._wake(wanted)

    def _wake(self, tags: list[str] | None) -> Projection:
        start = time.perf_counter()
        if tags is not None:
            self._check_tags("wake", tags)
        restoring = self.policy.wake_set(tags, self.projection.asleep_tags())
        self._emit(EventKind.WAKE_REQUESTED, tags=tags, restoring=restoring)
        progress = WakeProgress(tags, start)
        undone = False

        def undo_group(exc: TorporError) -> None:  # another rank failed: roll back here, then raise
            nonlocal undone
            undone = True
            fail_wake(self, progress, exc)

        try:
            for tag in restoring:
                source = "host" if self.projection.residency[tag].host else "fresh"
                done = self.memory.restore([tag])[tag]
                progress.restored.append((tag, done, source))
                self._emit(
                    EventKind.TAG_RESTORED,
                    tag=tag,
                    bytes=done.bytes,
                    source=source,
                    seconds=done.seconds,
                    **done.kept_fields(),
                )
            self._group_hold(undo_group)  # backups kept until the group agrees
        except BaseException as exc:  # an error, an interrupt, a log that cannot be written: roll back, raise
            if undone:  # the group's rollback ran already
                raise
            fail_wake(self, progress, exc)
        interrupt: BaseException | None = None
        try:
            self.memory.drop_backup([t for t, _, _ in progress.restored])
        except Exception:
            logger.exception("dropping backups after a wake failed; the wake itself succeeded")
        except BaseException as exc:  # an interrupt here: every tag is back, the wake stands; raised once recorded
            interrupt = exc
        host_released = release_unused_host(self.memory, self.host_policy)
        seconds = time.perf_counter() - start
        try:
            self._emit(
                EventKind.WAKE_COMPLETED,
                tags=tags,
                seconds=seconds,
                restored=sum(t.bytes for _, t, _ in progress.restored),
                pinned=pinned_bytes(self.memory),
                host_released=host_released,
            )
        except LogWriteFailed as exc:  # every tag is back and its backup gone: nothing to roll back to
            self._log_failure = f"the end of a wake could not be recorded ({exc}); every tag asked for is resident"
            raise
        if interrupt is not None:
            raise interrupt
        return self.projection
