"""Recovery: take each tag's residency from the memory after an interrupted transition, and record it.

:func:`reconcile` is the body of ``recover()``. :func:`settle` runs it at once
when an interrupt (``KeyboardInterrupt``, ``SystemExit``, or whatever a signal
handler raises, such as a watchdog's timeout) leaves a command mid-transition
in a live process, where the memory is known.
"""

from __future__ import annotations

import logging

from torpor.statemachine.core.events import Recovered
from torpor.statemachine.core.states import TRANSITIONAL
from torpor.statemachine.log.interrupts import UNINTERRUPTED
from torpor.statemachine.machine.context import Context
from torpor.statemachine.projection.view import Projection

logger = logging.getLogger("torpor")


def reconcile(ctx: Context) -> Projection:
    """Take each tag's residency from the memory and record it (``recovered``); the body of ``recover()``.

    A tag with nothing resident and bytes on the host (or discarded) is
    asleep, so the controller ends ``awake`` when everything is resident
    and ``partially_awake`` otherwise (a wake then restores the rest).
    """
    usage = ctx.memory.usage()
    released = {
        tag: {"host": u.host, "discarded": u.discarded}
        for tag, u in usage.items()
        if not u.resident and (u.host or u.discarded)
    }
    ctx.recorder.record(
        Recovered(
            usage={tag: u.resident for tag, u in usage.items()},
            released=released,
            interrupted_state=ctx.state.value,
            interrupted_step=ctx.projection.last_step,
        )
    )
    ctx.gate.recovered()
    return ctx.projection


def settle(ctx: Context, command: str, exc: BaseException) -> None:
    """An interrupt that leaves ``command`` mid-transition (it landed where no rollback catches it): reconcile now.

    The process is alive, so the memory is known: the controller takes
    each tag's residency from it, as :func:`reconcile` (``recover()``)
    does, instead of waiting in a transitional state for a ``recover()``.
    Not when the log could not record something (``NotRecovered`` names
    it then) or the memory cannot say: then ``recover()`` stays the way out.
    """
    if ctx.state not in TRANSITIONAL or ctx.gate.log_failure or ctx.recorder.closed_at:
        return
    try:
        with UNINTERRUPTED:
            logger.warning(
                "torpor: %s interrupted (%s) in %s at %s; reconciling with the memory as recover() does",
                command,
                type(exc).__name__,
                ctx.state.value,
                ctx.projection.last_step,
            )
            reconcile(ctx)
    except Exception:
        logger.exception("torpor: reconciling after an interrupted %s failed; recover() is needed", command)
