"""The discard step: drop asleep tags' backups, release resident deferrable tags without one, record.

A discard that fails ends through :func:`~torpor.statemachine.machine.rollback.discard_failed`
(a refusal when nothing changed yet, else ``discard_completed`` naming what went).
With a group, a discard of resident tags that another rank refused is undone
by :func:`~torpor.statemachine.machine.rollback.undo_discard` (the tags are woken
again, with fresh memory, by :func:`~torpor.statemachine.machine.waking.restore`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torpor.errors import InvalidTransition, TorporError
from torpor.statemachine.core.events import DiscardCompleted, TagDiscarded, TagReleased
from torpor.statemachine.core.policy import NEVER_DISCARD
from torpor.statemachine.machine.context import Context, _tag_list
from torpor.statemachine.machine.rollback import discard_failed, not_resident, undo_discard
from torpor.statemachine.machine.waking import restore
from torpor.statemachine.projection.view import Projection


def discard(ctx: Context, tags: Sequence[str] | str) -> Projection:
    """``discard(tags)`` inside the gate: guard, check each tag, drop asleep tags' backups, release resident ones."""
    ctx.gate.guard("discard")
    tags = _tag_list(tags)
    ctx.check_tags("discard", tags)
    projection = ctx.projection
    resident = [t for t in tags if t not in projection.asleep]
    for tag in tags:
        why = ""
        if tag in NEVER_DISCARD:
            why = f"{tag} is never discarded: graphs hold write-once state"
        elif tag in resident and tag not in ctx.policy.deferrable:
            deferrable = ", ".join(sorted(ctx.policy.deferrable))
            why = f"{tag!r} is resident and every wake restores it; only {deferrable} can be discarded while resident"
        if why:
            ctx.gate.refuse("discard", InvalidTransition("discard", projection.state.value, projection.since, (), why))
    host = [t for t in tags if t in projection.asleep and projection.residency[t].host]
    start = time.perf_counter()
    dropped: list[str] = []
    if host:
        ctx.hold(None)  # backups cannot come back: the group agrees before any is dropped
    for tag in host:
        try:
            ctx.memory.drop_backup([tag])
        except TorporError as exc:  # a refusal if nothing changed yet, else the discard ends partly done
            # see docs/architecture.md "Invariant: a failed command is undone newest first"
            discard_failed(ctx, start, exc, changed=bool(dropped), went=dropped)
        dropped.append(tag)
        ctx.recorder.record(TagDiscarded(tag=tag, bytes=projection.residency[tag].host))
    ctx.host.release_unused()
    if resident:
        _discard_resident(ctx, resident, dropped)
    return ctx.projection


def _discard_resident(ctx: Context, tags: list[str], dropped: list[str]) -> None:
    """Release resident tags without a backup (each tag fully or not at all); ``dropped``: backups gone already."""
    start = time.perf_counter()
    try:
        ctx.memory.drop_backup(tags)  # a stale backup must never come back as their content
    except TorporError as exc:  # a refusal if nothing changed yet, else partly done: asleep tags' backups went
        after = f" (after dropping the backups of {', '.join(dropped)})"
        discard_failed(ctx, start, exc, changed=bool(dropped), went=[], note=after)
    done: list[str] = []
    for tag in tags:
        try:
            released = ctx.memory.release([tag])[tag]
        except TorporError as exc:  # the tags released before it stay released: partly done
            gone = not_resident(ctx, tag)
            if gone:  # the memory could not put it back and released it: it went too
                ctx.recorder.record(TagReleased(tag=tag, bytes=gone, action="discard", seconds=0.0))
                done.append(tag)
            discard_failed(ctx, start, exc, changed=True, went=done)
        done.append(tag)
        ctx.recorder.record(
            TagReleased(
                tag=tag, bytes=released.bytes, action="discard", seconds=released.seconds, **released.kept_fields()
            )
        )
    ctx.recorder.record(
        DiscardCompleted(tags=tuple(done), error=None, reason=None, seconds=time.perf_counter() - start)
    )
    ctx.hold(lambda exc: undo_discard(lambda back: restore(ctx, back), done, exc))
