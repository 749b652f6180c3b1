"""torpor: put a GPU inference engine to sleep and wake it without losing a byte, and watch it happen."""

from __future__ import annotations

from torpor import errors
from torpor._version import __version__
from torpor.errors import (
    BadArgument,
    BadArgumentType,
    BadSetting,
    BlocksOpen,
    CommandInFlight,
    ControllerClosed,
    EndpointError,
    GroupFailed,
    HostBudgetExceeded,
    InvalidLevel,
    InvalidTransition,
    LogCorrupted,
    LogLocked,
    LogWriteFailed,
    MemoryOperationFailed,
    MissingExtra,
    NoEventLog,
    NoTagsNamed,
    NotAnEventLog,
    NotRecovered,
    OutOfMemory,
    PoolBusy,
    StateTimeout,
    TagNotAwake,
    TorporError,
    UnknownSchemaVersion,
    UnknownTag,
    UnsafeLogPath,
    WakeCheckFailed,
)
from torpor.statemachine import (
    Action,
    AfterWake,
    DeviceMemory,
    Event,
    EventKind,
    EventLog,
    HostMemoryPolicy,
    Memory,
    PinWhen,
    Policy,
    Projection,
    SleepController,
    State,
    TagUsage,
    Transfer,
    replay,
)

# The payload class of each event kind (``event.data``): what subscribers match on.
from torpor.statemachine.core.events import (
    PAYLOADS,
    Closed,
    CommandRepeated,
    DiscardCompleted,
    GraphCaptured,
    GroupAgreed,
    HookDecision,
    Opened,
    Payload,
    PoolCreated,
    PoolReleased,
    Recovered,
    Refused,
    SleepAborted,
    SleepCompleted,
    SleepRequested,
    Snapshot,
    TagBackedUp,
    TagDiscarded,
    TagReleased,
    TagRestored,
    TagRolledBack,
    UsageObserved,
    WakeCompleted,
    WakeFailed,
    WakeRequested,
)
from torpor.statemachine.machine.group import Agreement, adapt_groups

#: Names of the other subpackages, importable from ``torpor`` and loaded on first use, so that
#: ``import torpor`` stays light (no torch, no Prometheus registry touched).
_LAZY = {
    "TaggedAllocator": "torpor.allocator",
    "SimDriver": "torpor.allocator",
    "CudaDriver": "torpor.allocator",
    "HostPolicy": "torpor.allocator",
    "attach": "torpor.telemetry",
    "serve": "torpor.telemetry",
    "cudagraph_pool_decision": "torpor.hooks",
    "apply_nccl_defaults": "torpor.hooks",
    "register_graph_buffers": "torpor.hooks",
    "capture_pool": "torpor.hooks",
    "follow": "torpor.hooks",
    "fleet": "torpor.hooks",
    "Client": "torpor.client",
    "TrackRefused": "torpor.statemachine.machine.tracking",
    "NotReloaded": "torpor.errors",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'torpor' has no attribute {name!r}"
        raise AttributeError(msg)
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def _torch_group(group: object) -> Agreement | None:
    """A ``torch.distributed`` process group as ``torpor.torchgroup.TorchGroup`` (None: not a torch object).

    Handed down to :func:`torpor.statemachine.machine.group.as_agreement` when torpor loads, so
    ``SleepController(group=...)`` takes a torch group while the state machine imports no
    hooks; torpor.torchgroup imports torch, so it is loaded only for a torch group.
    """
    if not type(group).__module__.startswith("torch"):
        return None
    import importlib

    wrapped: Agreement = importlib.import_module("torpor.torchgroup").TorchGroup(group)
    return wrapped


adapt_groups(_torch_group)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Action",
    "AfterWake",
    "BadArgument",
    "BadArgumentType",
    "BadSetting",
    "BlocksOpen",
    "Client",
    "CommandInFlight",
    "ControllerClosed",
    "CudaDriver",
    "DeviceMemory",
    "EndpointError",
    "Event",
    "EventKind",
    "EventLog",
    "GroupFailed",
    "HostBudgetExceeded",
    "HostMemoryPolicy",
    "HostPolicy",
    "InvalidLevel",
    "InvalidTransition",
    "LogCorrupted",
    "LogLocked",
    "LogWriteFailed",
    "Memory",
    "MemoryOperationFailed",
    "MissingExtra",
    "NoEventLog",
    "NoTagsNamed",
    "NotAnEventLog",
    "NotRecovered",
    "NotReloaded",
    "OutOfMemory",
    "PinWhen",
    "Policy",
    "PoolBusy",
    "Projection",
    "SimDriver",
    "SleepController",
    "State",
    "StateTimeout",
    "TagNotAwake",
    "TagUsage",
    "TaggedAllocator",
    "TorporError",
    "TrackRefused",
    "Transfer",
    "UnknownSchemaVersion",
    "UnknownTag",
    "UnsafeLogPath",
    "WakeCheckFailed",
    "__version__",
    "apply_nccl_defaults",
    "attach",
    "capture_pool",
    "cudagraph_pool_decision",
    "errors",
    "fleet",
    "follow",
    "register_graph_buffers",
    "replay",
    "serve",
]
__all__ += [  # the payload classes, imported above
    "PAYLOADS",
    "Closed",
    "CommandRepeated",
    "DiscardCompleted",
    "GraphCaptured",
    "GroupAgreed",
    "HookDecision",
    "Opened",
    "Payload",
    "PoolCreated",
    "PoolReleased",
    "Recovered",
    "Refused",
    "SleepAborted",
    "SleepCompleted",
    "SleepRequested",
    "Snapshot",
    "TagBackedUp",
    "TagDiscarded",
    "TagReleased",
    "TagRestored",
    "TagRolledBack",
    "UsageObserved",
    "WakeCompleted",
    "WakeFailed",
    "WakeRequested",
]
