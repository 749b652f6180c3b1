"""The event-sourced sleep-state machine: states, events, the log, replay and the controller.

Four layers, each a subpackage that imports only those before it: :mod:`.core`
(the vocabulary: events, states, policy, the memory protocol), :mod:`.projection`
(the fold over events), :mod:`.log` (the event store on disk and its readers) and
:mod:`.machine` (the controller). Imports no torch and no CUDA: the memory it
drives is any object meeting :class:`Memory`; this facade exports the public names.
"""

from __future__ import annotations

from torpor.statemachine.core.events import SCHEMA_VERSION, Event, EventKind, thaw
from torpor.statemachine.core.policy import DEFAULT_POLICY, Action, AfterWake, HostMemoryPolicy, PinWhen, Policy
from torpor.statemachine.core.protocol import DeviceMemory, GraphPoolMemory, HostMemory, Memory, TagUsage, Transfer
from torpor.statemachine.core.states import (
    COMMANDS,
    GUARD,
    TRANSITIONS,
    State,
    Verdict,
    allowed_sources,
    decide,
    diagram_markdown,
    mermaid,
)
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.fanout import Fanout
from torpor.statemachine.log.reader import decode_line, read_events, read_events_file, replay, segments
from torpor.statemachine.log.tail import Tail
from torpor.statemachine.machine.controller import SleepController, log_path_for
from torpor.statemachine.machine.group import Agreement, GroupMember
from torpor.statemachine.machine.localgroup import LocalGroup
from torpor.statemachine.projection.view import Projection, project

__all__ = [
    "COMMANDS",
    "DEFAULT_POLICY",
    "GUARD",
    "SCHEMA_VERSION",
    "TRANSITIONS",
    "Action",
    "AfterWake",
    "Agreement",
    "DeviceMemory",
    "Event",
    "EventKind",
    "EventLog",
    "Fanout",
    "GraphPoolMemory",
    "GroupMember",
    "HostMemory",
    "HostMemoryPolicy",
    "LocalGroup",
    "Memory",
    "PinWhen",
    "Policy",
    "Projection",
    "SleepController",
    "State",
    "TagUsage",
    "Tail",
    "Transfer",
    "Verdict",
    "allowed_sources",
    "decide",
    "decode_line",
    "diagram_markdown",
    "log_path_for",
    "mermaid",
    "project",
    "read_events",
    "read_events_file",
    "replay",
    "segments",
    "thaw",
]
