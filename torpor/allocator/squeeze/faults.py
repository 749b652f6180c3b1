"""The errors a squeezed backup raises: a header refused, a chunk's structure broken, a chunk's checksum wrong.

Each carries where: the chunk's index, the original bytes it covers (``start``, ``end``) and
where its record lies in the stream, so a caller can name the tag and address range above it.
"""

from __future__ import annotations

from torpor.errors import TorporError


class SqueezeError(TorporError, ValueError):
    """Base of the errors of torpor.allocator.squeeze: a stream refused or a chunk that does not check."""


class BadHeader(SqueezeError):
    """A stream's header or a chunk's header is not one the format allows (``where``: stream offset; ``field``; ``reason``)."""

    def __init__(self, where: int, field: str, reason: str, chunk: int | None = None) -> None:
        self.where, self.field, self.reason, self.chunk = where, field, reason, chunk
        of = f"chunk {chunk}'s header" if chunk is not None else "the stream header"
        msg = f"squeezed backup refused: {of} at stream byte {where}: {field} {reason}; nothing was decoded"
        super().__init__(msg)


class CorruptChunk(SqueezeError):
    """A coded chunk's payload does not hold together (``reason``); original bytes ``start``..``end``, stream ``at``."""

    def __init__(self, chunk: int, start: int, end: int, at: int, reason: str) -> None:
        self.chunk, self.start, self.end, self.at, self.reason = chunk, start, end, at, reason
        msg = (
            f"squeezed backup chunk {chunk} (original bytes {start}..{end}, stream byte {at}) is corrupt: {reason}; "
            "its bytes cannot be restored from this backup"
        )
        super().__init__(msg)


class ChecksumMismatch(SqueezeError):
    """A chunk decoded to bytes whose sum64 is not the one recorded at encode time: the backup or the restore is wrong."""

    def __init__(self, chunk: int, start: int, end: int, expected: int, found: int) -> None:
        self.chunk, self.start, self.end, self.expected, self.found = chunk, start, end, expected, found
        msg = (
            f"squeezed backup chunk {chunk} (original bytes {start}..{end}) restored with checksum {found:#018x}, "
            f"recorded {expected:#018x}: those bytes are not the ones backed up"
        )
        super().__init__(msg)


__all__ = ["BadHeader", "ChecksumMismatch", "CorruptChunk", "SqueezeError"]
