"""The event log's errors: a file torpor will not write or cannot read, an event it cannot record."""

from __future__ import annotations

from torpor.errors.base import TorporError

__all__ = [
    "BadEvent",
    "EventTooLarge",
    "LogClosed",
    "LogCorrupted",
    "LogLocked",
    "LogWriteFailed",
    "NoEventLog",
    "NoEvents",
    "NotAnEventLog",
    "NothingWritten",
    "ReadOnlyPayload",
    "SchemaDefinitionError",
    "SchemaIncomplete",
    "UnknownSchemaVersion",
    "UnsafeLogPath",
]


class LogCorrupted(TorporError, ValueError):
    """An event log line that is not a valid event (not the torn last line)."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: corrupted event log line: {reason}")


class UnknownSchemaVersion(TorporError, ValueError):
    """An event written by a schema this torpor does not read."""

    def __init__(self, path: str, line: int, version: object, supported: int) -> None:
        self.path, self.line, self.version, self.supported = path, line, version, supported
        super().__init__(
            f"{path}:{line}: event schema version {version!r} is not supported "
            f"(this torpor reads version {supported}); upgrade torpor to read this log"
        )


class EventTooLarge(TorporError, ValueError):
    """An event whose encoded form exceeds the log's line limit."""

    def __init__(self, kind: str, size: int, limit: int) -> None:
        self.kind, self.size, self.limit = kind, size, limit
        super().__init__(f"event {kind!r} encodes to {size} bytes, over the {limit}-byte line limit")


class UnsafeLogPath(TorporError, PermissionError):
    """An event log path torpor will not write: a link, not a regular file, or owned or writable by someone else."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"refusing to write the event log {path}: {reason}")


class NotAnEventLog(TorporError, ValueError):
    """An existing file passed as an event log that is not one: torpor will not truncate or append to it."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"refusing to write the event log {path}: the file exists and is not a torpor event log ({reason}); "
            "give a new path or a directory"
        )


class LogLocked(TorporError, RuntimeError):
    """Another writer holds the event log (one writer per log, locked for the writer's lifetime)."""

    def __init__(self, path: str, holder: str) -> None:
        self.path = path
        self.holder = holder
        super().__init__(
            f"cannot write the event log {path}: it is held by another writer ({holder}); "
            "each engine rank needs its own log (set a different engine name, rank or log directory)"
        )


class LogWriteFailed(TorporError, OSError):
    """An event could not be written (a full disk, an I/O error); the log was cut back to its last whole line."""

    def __init__(self, path: str, kind: str, seq: int, reason: str) -> None:
        self.path = path
        self.kind = kind
        self.seq = seq
        self.reason = reason
        super().__init__(
            f"writing event #{seq} ({kind}) to {path} failed: {reason}; the log ends at its last whole line "
            "and the event is not recorded"
        )


class NoEventLog(TorporError, FileNotFoundError):
    """No event log where one was named (a path, a directory with no ``*.jsonl``)."""


class NoEvents(TorporError, ValueError):
    """A log that holds no complete event yet (or none a reader can use, such as a plot)."""


class LogClosed(TorporError, ValueError):
    """A write to an event log that was closed."""


class NothingWritten(TorporError, OSError):
    """``write`` wrote no byte of an event's line (read as a full disk, ``ENOSPC``)."""


class BadEvent(TorporError, ValueError):
    """An event (or a field of one) that is not a valid event: an unknown kind, a field of the wrong type."""


class SchemaDefinitionError(TorporError, TypeError):
    """A payload class defined against the schema's rules (no kind, a mutable default, a field named like a method)."""


class SchemaIncomplete(TorporError, ImportError):
    """The event schema's tables disagree (a kind without a payload class, a field without a check): found at import."""


class ReadOnlyPayload(TorporError, TypeError):
    """A write to an event's payload: payloads are read-only, a new event is built instead."""
