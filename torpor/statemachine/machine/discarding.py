"""The discard command: drop asleep tags' backups, release resident deferrable tags without one, record.

A discard that fails ends through :func:`~torpor.statemachine.machine.rollback.discard_failed`
(a refusal when nothing changed yet, else ``discard_completed`` naming what went).
With a group, a discard of resident tags that another rank refused is undone
by :func:`~torpor.statemachine.machine.rollback.undo_discard` (the tags are woken
again, with fresh memory).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torpor.errors import InvalidTransition, TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.policy import NEVER_DISCARD
from torpor.statemachine.machine.base import _tag_list
from torpor.statemachine.machine.group import collective
from torpor.statemachine.machine.hostmem import release_unused_host
from torpor.statemachine.machine.rollback import discard_failed, not_resident, undo_discard
from torpor.statemachine.machine.waking import Waking
from torpor.statemachine.projection.view import Projection


class Discarding(Waking):
    """``discard(tags)``; builds on :class:`Waking`, whose wake is a group discard's compensation."""

    @collective("discard")
    def discard(self, tags: Sequence[str] | str) -> Projection:
        """Discard ``tags``; the next wake that restores them maps fresh memory.

        An asleep tag loses its host backup. A resident deferrable tag (``weights``,
        ``kv_cache``) is released without a backup, as vLLM's
        ``release_kv_cache_memory()`` asks, and an awake engine becomes
        ``partially_awake``. ``cudagraph`` is never discarded, and a resident tag
        that every wake restores cannot be discarded either.
        """
        with self._command("discard", tags=tags):
            self._guard("discard")
            tags = _tag_list(tags)
            self._check_tags("discard", tags)
            resident = [t for t in tags if t not in self.projection.asleep]
            for tag in tags:
                why = ""
                if tag in NEVER_DISCARD:
                    why = f"{tag} is never discarded: graphs hold write-once state"
                elif tag in resident and tag not in self.policy.deferrable:
                    deferrable = ", ".join(sorted(self.policy.deferrable))
                    why = f"{tag!r} is resident and every wake restores it; only {deferrable} can be discarded while resident"
                if why:
                    self._refuse(
                        "discard", InvalidTransition("discard", self.state.value, self.projection.since, (), why)
                    )
            host = [t for t in tags if t in self.projection.asleep and self.projection.residency[t].host]
            start = time.perf_counter()
            dropped: list[str] = []
            if host:
                self._group_hold(None)  # backups cannot come back: the group agrees before any is dropped
            for tag in host:
                try:
                    self.memory.drop_backup([tag])
                except TorporError as exc:  # a refusal if nothing changed yet, else the discard ends partly done
                    discard_failed(self, start, exc, changed=bool(dropped), went=dropped)
                dropped.append(tag)
                self._emit(EventKind.TAG_DISCARDED, tag=tag, bytes=self.projection.residency[tag].host)
            release_unused_host(self.memory, self.host_policy)
            if resident:
                self._discard_resident(resident, dropped)
            return self.projection

    def _discard_resident(self, tags: list[str], dropped: list[str]) -> None:
        """Release resident tags without a backup (each tag fully or not at all); ``dropped``: backups gone already."""
        start = time.perf_counter()
        try:
            self.memory.drop_backup(tags)  # a stale backup must never come back as their content
        except TorporError as exc:  # a refusal if nothing changed yet, else partly done: asleep tags' backups went
            after = f" (after dropping the backups of {', '.join(dropped)})"
            discard_failed(self, start, exc, changed=bool(dropped), went=[], note=after)
        done: list[str] = []
        for tag in tags:
            try:
                released = self.memory.release([tag])[tag]
            except TorporError as exc:  # the tags released before it stay released: partly done
                gone = not_resident(self, tag)
                if gone:  # the memory could not put it back and released it: it went too
                    self._emit(EventKind.TAG_RELEASED, tag=tag, bytes=gone, action="discard", seconds=0.0)
                    done.append(tag)
                discard_failed(self, start, exc, changed=True, went=done)
            done.append(tag)
            self._emit(
                EventKind.TAG_RELEASED,
                tag=tag,
                bytes=released.bytes,
                action="discard",
                seconds=released.seconds,
                **released.kept_fields(),
            )
        self._emit(
            EventKind.DISCARD_COMPLETED,
            tags=done,
            error=None,
            reason=None,
            seconds=time.perf_counter() - start,
        )
        self._group_hold(lambda exc: undo_discard(self._wake, done, exc))
