"""Errors of the allocator: driver failures and refused allocator operations, all ``TorporError``s."""

from __future__ import annotations

from torpor.errors import (  # noqa: F401 (re-exported: the old import path)
    AllocatorError,
    AllocatorOutOfMemory,
    DriverError,
    DriverOutOfMemory,
    MemoryOperationFailed,
    OutOfMemory,
    TagNotAwake,
)


class TagNotAwakeFor(TagNotAwake):
    """A raw call (``operation``: allocate, write) into a tag asleep or going to sleep; names the state and the sleep.

    The same refusal as a ``use_memory_pool`` block of such a tag (:class:`~torpor.errors.TagNotAwake`), for the
    raw API; ``detail`` says what was asked (an address, a size).
    """

    def __init__(self, operation: str, tag: str, state: str, cause: str, detail: str = "") -> None:
        self.state = state
        self.cause = cause
        by = f" ({cause})" if cause else ""
        what = f"{detail}: " if detail else ""
        reason = f"{what}tag {tag!r} is {state}{by}; wake it first"
        AllocatorError.__init__(self, operation, tag, reason)


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


__all__ = ["AllocatorError", "AllocatorOutOfMemory", "DriverError", "DriverOutOfMemory", "TagNotAwakeFor", "wrap"]
