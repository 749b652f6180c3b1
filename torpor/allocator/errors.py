"""Errors of the allocator: driver failures and refused allocator operations, all ``TorporError``s."""

from __future__ import annotations

from torpor.errors import MemoryOperationFailed, OutOfMemory


class DriverError(MemoryOperationFailed):
    """A driver call failed; ``call`` names it and ``code`` is the driver's error code when known."""

    def __init__(self, call: str, reason: str, code: int | None = None) -> None:
        self.code = code
        super().__init__("driver call", None, reason, call=call)


class DriverOutOfMemory(DriverError, OutOfMemory):
    """A driver call ran out of device or pinned host memory."""


class AllocatorError(MemoryOperationFailed):
    """An allocator operation (allocate, backup, release, restore, capture) failed or was refused."""


class AllocatorOutOfMemory(AllocatorError, OutOfMemory):
    """An allocator operation ran out of device or pinned host memory; nothing was lost."""


def wrap(operation: str, tag: str | None, exc: BaseException) -> AllocatorError:
    """Turn a driver error (or any exception) into the allocator error for ``operation`` on ``tag``."""
    call = getattr(exc, "call", None)
    reason = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    if isinstance(exc, OutOfMemory):
        return AllocatorOutOfMemory(operation, tag, reason, call=call)
    return AllocatorError(operation, tag, reason, call=call)
