"""The SleepController: guards every memory command, plans it, drives the memory, records events.

The flow has one direction: a command is guarded by the transition table (one
verdict per state and command, :func:`torpor.statemachine.core.states.decide`, and
nothing else decides whether a state accepts a command), planned by the
policy, executed by the memory object (mechanism only), and recorded as
events; the state and per-tag residency are a projection of those events, the
same one :func:`torpor.statemachine.replay` computes from the log, and the
events move it only along the table's edges (the tests check each one). There
is one state model: no ``transitions.Machine`` or other object holds a second
copy of the state (:mod:`torpor.statemachine.core.states` says why).
Subscribers (telemetry, RL feeds) are called after each event and can never
break the controller. Commands are serialized: one arriving while another is in
flight is refused (``CommandInFlight``), never queued behind a lock.

Anything raised inside a sleep or a wake (a memory error, a ``KeyboardInterrupt``,
a log that cannot be written) rolls the command back, then is raised again. When
the rollback itself cannot be recorded the controller stays in the transitional
state and refuses with ``NotRecovered`` until :meth:`SleepController.recover`,
which takes each tag's residency from the memory as it is.

The controller is assembled from modules of one job each:

- :mod:`~torpor.statemachine.machine.base`: construction, the event recorder
  (``_emit``), the reading API;
- :mod:`~torpor.statemachine.machine.gate`: one command at a time, the guard (the
  table's verdict, and the error it names), refusals and idempotent no-ops;
- :mod:`~torpor.statemachine.machine.sleeping`, :mod:`~torpor.statemachine.machine.waking`,
  :mod:`~torpor.statemachine.machine.discarding`, :mod:`~torpor.statemachine.machine.graphs`:
  the memory commands;
- :mod:`~torpor.statemachine.machine.rollback`: every compensating step (from the
  progress a sleep or wake records as it goes) and the events it records;
- :mod:`~torpor.statemachine.machine.group`: the ``@collective`` glue for process groups;
- :mod:`~torpor.statemachine.machine.hostmem`: the host-memory policy's side;
- :mod:`~torpor.statemachine.machine.lifecycle`: ``observe``, ``record``, ``recover``, ``close``;
- :mod:`~torpor.statemachine.machine.tracking`: ``track`` (a module kept whole across a discard of its tag).
"""

from __future__ import annotations

from torpor.statemachine.machine.base import GiB, Subscriber, _clip, _tag_list, log_path_for
from torpor.statemachine.machine.discarding import Discarding
from torpor.statemachine.machine.graphs import GraphPool
from torpor.statemachine.machine.lifecycle import Lifecycle
from torpor.statemachine.machine.sleeping import Sleeping
from torpor.statemachine.machine.tracking import Tracking

__all__ = ["GiB", "SleepController", "Subscriber", "_clip", "_tag_list", "log_path_for"]


class SleepController(Sleeping, Discarding, GraphPool, Lifecycle, Tracking):
    """Guards, plans and records every memory command of one engine rank.

    ``memory`` meets :class:`~torpor.statemachine.core.protocol.Memory`; ``log`` is
    an :class:`EventLog`, a file path (an existing file, or a new path with a
    suffix such as ``.jsonl``), a directory (an existing one, a path ending in
    ``/``, or a new path without a suffix; the file is ``ENGINE.rankN.jsonl``
    inside it) or None (events kept in memory only). ``rank`` is an int
    0..2**63-1 and, with a directory, ``engine`` a plain file name (no
    separator, not ``..``): both are checked before any file is made
    (:func:`~torpor.statemachine.machine.base.check_identity`). Opening an
    existing log reads it from the snapshot that opens its newest file, not
    its whole history.

    ``group`` (a ``torch.distributed`` process group of any backend, whose
    rendezvous store carries the votes, or any
    :class:`~torpor.statemachine.machine.group.Agreement`) makes ``sleep``, ``wake``
    and ``discard`` collective: they complete only when every rank succeeded,
    else every rank rolls back and raises ``GroupFailed``; a rank silent for
    ``group_timeout`` seconds counts as failed (docs/groups.md).
    """
