"""torpor: put a GPU inference engine to sleep and wake it without losing a byte, and watch it happen."""

from __future__ import annotations

from torpor import errors
from torpor.errors import (
    CommandInFlight,
    InvalidLevel,
    InvalidTransition,
    LogCorrupted,
    MemoryOperationFailed,
    NotRecovered,
    OutOfMemory,
    PoolBusy,
    TorporError,
    UnknownSchemaVersion,
    UnknownTag,
)
from torpor.statemachine import (
    Action,
    Event,
    EventKind,
    EventLog,
    Memory,
    Policy,
    Projection,
    SleepController,
    State,
    TagUsage,
    Transfer,
    replay,
)

__version__ = "0.1.0"

__all__ = [
    "Action",
    "CommandInFlight",
    "Event",
    "EventKind",
    "EventLog",
    "InvalidLevel",
    "InvalidTransition",
    "LogCorrupted",
    "Memory",
    "MemoryOperationFailed",
    "NotRecovered",
    "OutOfMemory",
    "Policy",
    "PoolBusy",
    "Projection",
    "SleepController",
    "State",
    "TagUsage",
    "TorporError",
    "Transfer",
    "UnknownSchemaVersion",
    "UnknownTag",
    "__version__",
    "errors",
    "replay",
]
