"""The memory's errors: a driver call or an allocator operation that failed or was refused."""

from __future__ import annotations

from collections.abc import Sequence

from torpor.errors.base import TorporError

__all__ = [
    "AllocatorArgumentError",
    "AllocatorError",
    "AllocatorOutOfMemory",
    "BlocksOpen",
    "DriverError",
    "DriverOutOfMemory",
    "MemoryOperationFailed",
    "OutOfMemory",
    "TagNotAwake",
    "WakeCheckFailed",
]


class MemoryOperationFailed(TorporError, RuntimeError):
    """A memory operation failed: ``operation`` (the step), ``tag``, ``call`` (the driver call, when known)."""

    def __init__(self, operation: str, tag: str | None, reason: str, call: str | None = None) -> None:
        self.operation, self.tag, self.call, self.reason = operation, tag, call, reason
        where = f" of tag {tag!r}" if tag else ""
        via = f" ({call})" if call else ""
        super().__init__(f"{operation}{where} failed{via}: {reason}")


class OutOfMemory(MemoryOperationFailed):
    """Device or host memory ran out during a memory operation."""


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


class AllocatorArgumentError(AllocatorError, ValueError):
    """An allocator call got a value it cannot take (a size, address or device out of range, an unusable tag name); nothing changed."""


class TagNotAwake(AllocatorError):
    """A block (or raw ``operation``, ``detail`` what) into a tag asleep or going to sleep (``state``; ``cause``: the sleep)."""

    def __init__(self, tag: str, state: str, cause: str, operation: str = "use_memory_pool", detail: str = "") -> None:
        self.state, self.cause = state, cause
        by, what = f" ({cause})" if cause else "", f"{detail}: " if detail else ""
        then = "before allocating in it" if operation == "use_memory_pool" else "first"
        super().__init__(operation, tag, f"{what}tag {tag!r} is {state}{by}; wake it {then}")


class BlocksOpen(AllocatorError):
    """A sleep found blocks of its tags open (another thread's past the wait, or its own); ``holders``: tag and thread."""

    def __init__(self, reason: str, holders: Sequence[str]) -> None:
        self.holders = tuple(holders)
        super().__init__("sleep", None, reason)


class WakeCheckFailed(AllocatorError):
    """A wake's restored bytes differ from what its sleep backed up (every wake is checked, issue 53).

    ``address`` and ``nbytes``: the first chunk that differs; ``chunk``: its index in the backed-up
    piece at ``piece``; ``recorded`` and ``found``: the chunk's sum64 at sleep and after the wake;
    ``count``: how many chunks of the tag differ. The wake is rolled back: the tag stays asleep with
    its backup kept, and nothing of it is reported awake.
    """

    def __init__(
        self, tag: str, *, address: int, nbytes: int, piece: int, chunk: int, recorded: int, found: int, count: int
    ) -> None:
        self.address, self.nbytes, self.piece, self.chunk = address, nbytes, piece, chunk
        self.recorded, self.found, self.count = recorded, found, count
        reason = (
            f"the restored bytes {address:#x}..{address + nbytes:#x} (chunk {chunk} of the piece backed up at "
            f"{piece:#x}) do not match the checksum taken at sleep (sum64 {recorded:#018x}, found {found:#018x}); "
            f"{count} chunk(s) of the tag differ; the wake was rolled back: the tag stays asleep, its backup kept"
        )
        super().__init__("restore", tag, reason, call="wake check")
