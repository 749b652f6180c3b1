"""A driver failure as the allocator's error, with what it left behind (:func:`wrap`).

The error classes themselves are :mod:`torpor.errors`' (``AllocatorError``, ``DriverError``, ...);
:mod:`torpor.allocator` exports them too.
"""

from __future__ import annotations

from torpor.errors import AllocatorError, AllocatorOutOfMemory, OutOfMemory


def wrap(operation: str, tag: str | None, exc: BaseException, outcome: str = "") -> AllocatorError:
    """Turn a driver error (or any exception) into the allocator error for ``operation`` on ``tag``.

    ``outcome``: what the failure left behind, said after the reason in parentheses (``"tag left resident"``).
    """
    call = getattr(exc, "call", None)
    reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    if outcome:
        reason = f"{reason} ({outcome})"
    if isinstance(exc, OutOfMemory):
        return AllocatorOutOfMemory(operation, tag, reason, call=call)
    return AllocatorError(operation, tag, reason, call=call)


__all__ = ["wrap"]
