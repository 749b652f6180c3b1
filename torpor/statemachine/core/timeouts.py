"""One rule for a timeout a caller gives in seconds: a finite int or float >= 0.

``nan`` passes no comparison, so a deadline built from it is never reached: a
wait given ``timeout=nan`` blocked forever. ``inf`` overflows the platform's
clock, and a negative number is a deadline in the past. Every wait that takes
seconds (:meth:`SleepController.wait_for <torpor.statemachine.SleepController.wait_for>`,
``Client.wait_for``, the CLI's ``--timeout``) refuses them through
:func:`timeout_seconds`, before it waits.
"""

from __future__ import annotations

import math

from torpor.errors import BadArgument

__all__ = ["timeout_seconds"]


def timeout_seconds(value: object, name: str = "timeout", *, refused: str = "") -> float:
    """``value`` as seconds when it is a finite int or float >= 0 (not a bool); else ValueError naming ``name``.

    ``refused`` ends the message with what was not done (``" (nothing was asked of URL)"``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:  # nan: False
        msg = f"{name}={value!r} is refused: give a finite number of seconds >= 0{refused}"
        raise BadArgument(msg)
    return float(value)
