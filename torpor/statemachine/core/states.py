"""The states, the transition table and the guard drawn from it: one state model, as data.

:data:`TRANSITIONS` declares every edge of the lifecycle: the commands a caller
issues (:data:`COMMANDS`) and the steps the controller takes itself to end
them (:data:`STEPS`). From it and from :data:`REFUSALS` (the refusals that are
not a plain ``InvalidTransition``) the module builds :data:`GUARD`, one
:class:`Verdict` per state and command: accepted (and where it can lead) or
refused (which error, why). The controller's gate asks :func:`decide` and
nothing else about whether a command may run; the docs' diagram and its table
are generated from the same data (``torpor diagram``; a test keeps
``docs/state-diagram.md`` current).

*Why torpor's own table and not the ``transitions`` package* (which an earlier
version stepped beside the projection, only to cross-check it). The state is a
projection of the events (the same fold live and in replay), so a second object
holding the state, as a ``transitions.Machine`` model does, can only follow it;
a verdict here is one dict lookup where a ``Machine`` trigger cost 16 to 35 µs,
on every command and every step; its refusal (``MachineError: Can't trigger
event sleep from state asleep_l1!``) names neither since when nor what holds
the state, so every message was rebuilt anyway; its machine is not thread-safe
without ``LockedMachine`` while the controller serializes commands itself; and
the Mermaid diagram is drawn from this data without its diagrams extension.
docs/statemachine.md has the figures. The steps' conditions (``level_is_1``,
``all_resident``, ...) are predicates of the projection in :data:`CONDITIONS`;
:func:`destination` evaluates them, which the tests use to check that the
events move the state only along the table's edges.

This module is the core layer: no I/O, no threads, no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NotRequired, Protocol, TypedDict

from torpor.errors import BadArgument, InvalidTransition, NotRecovered, PoolBusy, TableContradiction, TorporError


class State(enum.StrEnum):
    """The lifecycle states of one engine process."""

    AWAKE = "awake"
    SUSPENDING = "suspending"
    ASLEEP_L1 = "asleep_l1"
    ASLEEP_L2 = "asleep_l2"
    PARTIALLY_AWAKE = "partially_awake"
    RESUMING = "resuming"

    def __str__(self) -> str:
        return self.value


A, S, L1, L2, P, R = (s.value for s in State)

#: Transitional states: a log ending in one of these was interrupted.
TRANSITIONAL: frozenset[State] = frozenset({State.SUSPENDING, State.RESUMING})
ASLEEP: frozenset[State] = frozenset({State.ASLEEP_L1, State.ASLEEP_L2})


class Row(TypedDict):
    """One row of :data:`TRANSITIONS`: ``trigger`` from ``source`` (one state or a list) to ``dest``."""

    trigger: str
    source: str | list[str]
    dest: str | None  # None: an internal transition (the command keeps the state)
    conditions: NotRequired[str]  # the row applies when this predicate of CONDITIONS holds
    unless: NotRequired[str]  # ... or when this one does not


#: The transition table. ``trigger`` is the command (or internal step),
#: ``dest`` None marks an internal transition (a guarded command that does not
#: change the state). ``conditions`` / ``unless`` name predicates of :data:`CONDITIONS`.
TRANSITIONS: list[Row] = [
    {"trigger": "sleep", "source": [A, P], "dest": S},
    {"trigger": "finish_sleep", "source": S, "dest": L1, "conditions": "level_is_1"},
    {"trigger": "finish_sleep", "source": S, "dest": L2, "conditions": "level_is_2"},
    {"trigger": "abort_sleep", "source": S, "dest": A, "conditions": "came_from_awake"},
    {"trigger": "abort_sleep", "source": S, "dest": P, "conditions": "came_from_partial"},
    {"trigger": "wake", "source": [L1, L2, P], "dest": R},
    {"trigger": "finish_wake", "source": R, "dest": A, "conditions": "all_resident"},
    {"trigger": "finish_wake", "source": R, "dest": P, "unless": "all_resident"},
    {"trigger": "fail_wake", "source": R, "dest": L1, "conditions": "came_from_l1"},
    {"trigger": "fail_wake", "source": R, "dest": L2, "conditions": "came_from_l2"},
    {"trigger": "fail_wake", "source": R, "dest": P, "conditions": "came_from_partial"},
    {"trigger": "discard", "source": [L1, L2, P], "dest": None},
    {"trigger": "discard", "source": A, "dest": P},
    {"trigger": "capture", "source": A, "dest": None},
    {"trigger": "release_pool", "source": [A, P], "dest": None},
    {"trigger": "recover", "source": [S, R], "dest": A, "conditions": "all_resident"},
    {"trigger": "recover", "source": [S, R], "dest": P, "unless": "all_resident"},
]

#: Triggers a caller issues; the rest are steps the controller takes itself.
COMMANDS: tuple[str, ...] = ("sleep", "wake", "discard", "capture", "release_pool", "recover")

#: The controller's own steps, each with the event kind that takes it (what the fold reads).
STEPS: Mapping[str, str] = {
    "finish_sleep": "sleep_completed",
    "abort_sleep": "sleep_aborted",
    "finish_wake": "wake_completed",
    "fail_wake": "wake_failed",
}

#: The event kind that moves the state for each trigger that can change it (commands and steps).
TRIGGER_EVENTS: Mapping[str, str] = {
    "sleep": "sleep_requested",
    "wake": "wake_requested",
    "discard": "discard_completed",
    "recover": "recovered",
    **STEPS,
}


class Facts(Protocol):
    """What the conditions read: the projection's fields after the event that takes the step."""

    level: int | None
    resume_from: State | None

    def asleep_tags(self) -> list[str]:
        """Tags released and not restored since."""
        ...


#: The predicates the rows' ``conditions`` / ``unless`` name, over the projection.
CONDITIONS: Mapping[str, Callable[[Facts], bool]] = {
    "level_is_1": lambda p: p.level == 1,
    "level_is_2": lambda p: p.level == 2,
    "came_from_awake": lambda p: p.resume_from is State.AWAKE,
    "came_from_partial": lambda p: p.resume_from is State.PARTIALLY_AWAKE,
    "came_from_l1": lambda p: p.resume_from is State.ASLEEP_L1,
    "came_from_l2": lambda p: p.resume_from is State.ASLEEP_L2,
    "all_resident": lambda p: not p.asleep_tags(),
}

_NOT_RECOVERED = "the log ends inside a transition: recover() first"
_POOL_ASLEEP = "cudagraph pool is asleep"

#: Refusals other than a plain ``InvalidTransition``: (state, command) -> (error class, why).
#: An interrupted log (a transitional state between commands) accepts only ``recover``;
#: the cudagraph pool cannot be released while asleep (freeing it would unmap a second time).
REFUSALS: Mapping[tuple[State, str], tuple[type[TorporError], str]] = {
    **{(s, c): (NotRecovered, _NOT_RECOVERED) for s in TRANSITIONAL for c in COMMANDS if c != "recover"},
    **{(s, "release_pool"): (PoolBusy, _POOL_ASLEEP) for s in ASLEEP},
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the table says of ``command`` in ``state``.

    ``dests``: where an accepted command leads (the state itself for one that
    keeps it; a transitional state for ``sleep`` and ``wake``, whose steps end
    them); empty when refused. ``allowed``: the states that accept the command,
    in table order. ``error``: the class to refuse with, None when accepted;
    ``reason``: why, beyond "not allowed from here" (empty for a plain
    ``InvalidTransition``).
    """

    command: str
    state: State
    dests: tuple[State, ...]
    allowed: tuple[str, ...]
    error: type[TorporError] | None
    reason: str = ""

    @property
    def accepted(self) -> bool:
        """True when the command may run in this state."""
        return self.error is None


def _sources(row: Row) -> list[str]:
    return row["source"] if isinstance(row["source"], list) else [row["source"]]


def allowed_sources(trigger: str) -> tuple[str, ...]:
    """States from which ``trigger`` is accepted, in table order, without repeats."""
    seen: list[str] = []
    for row in TRANSITIONS:
        if row["trigger"] == trigger:
            seen.extend(s for s in _sources(row) if s not in seen)
    return tuple(seen)


def _verdict(state: State, command: str) -> Verdict:
    allowed = allowed_sources(command)
    if state.value in allowed:
        if (state, command) in REFUSALS:
            msg = f"the transition table accepts {command} from {state.value} and REFUSALS refuses it"
            raise TableContradiction(msg)
        dests = [State(row["dest"] or state.value) for row in _rows(command) if state.value in _sources(row)]
        return Verdict(command, state, tuple(dict.fromkeys(dests)), allowed, None)
    error, reason = REFUSALS.get((state, command), (InvalidTransition, ""))
    return Verdict(command, state, (), allowed, error, reason)


def _rows(trigger: str) -> list[Row]:
    return [row for row in TRANSITIONS if row["trigger"] == trigger]


#: Every state and command's verdict: the guard, built once (a typo in the table fails at import).
GUARD: Mapping[tuple[State, str], Verdict] = {(s, c): _verdict(s, c) for s in State for c in COMMANDS}


def decide(state: State, command: str) -> Verdict:
    """The table's verdict on ``command`` in ``state`` (raises ``ValueError`` for a name that is no command)."""
    try:
        return GUARD[state, command]
    except KeyError:
        msg = f"{command!r} is not a command; the commands are {', '.join(COMMANDS)}"
        raise BadArgument(msg) from None


def destination(source: State, trigger: str, facts: Facts) -> State | None:
    """Where ``trigger`` from ``source`` leads given the projection's ``facts`` (None: no row applies)."""
    for row in _rows(trigger):
        if source.value not in _sources(row):
            continue
        if "conditions" in row and not CONDITIONS[row["conditions"]](facts):
            continue
        if "unless" in row and CONDITIONS[row["unless"]](facts):
            continue
        return State(row["dest"] or source.value)
    return None


def mermaid() -> str:
    """The state diagram in Mermaid, generated from :data:`TRANSITIONS`."""
    lines = ["stateDiagram-v2", f"    [*] --> {A}"]
    for row in TRANSITIONS:
        for src in _sources(row):
            dest = row["dest"] or src
            guard = row.get("conditions") or (f"not {row['unless']}" if "unless" in row else "")
            label = row["trigger"] + (f" [{guard}]" if guard else "")
            lines.append(f"    {src} --> {dest}: {label}")
    for settled in (s for s in State if s not in TRANSITIONAL):  # close() waits for a command in flight
        lines.append(f"    {settled.value} --> closed: close()")
    lines.append("    closed --> awake: opened (a new controller on the same log)")
    return "\n".join(lines) + "\n"


def guard_table() -> str:
    """The guard as a Markdown table: per state (rows) and command (columns), where it leads or how it is refused."""

    def cell(v: Verdict) -> str:
        if v.accepted:
            return " / ".join(d.value for d in v.dests)
        return f"✗ {v.error.__name__ if v.error else ''}"

    head = "| state | " + " | ".join(f"`{c}`" for c in COMMANDS) + " |"
    rule = "| --- |" + " --- |" * len(COMMANDS)
    rows = [f"| {s.value} | " + " | ".join(cell(GUARD[s, c]) for c in COMMANDS) + " |" for s in State]
    return "\n".join([head, rule, *rows]) + "\n"


def diagram_markdown() -> str:
    """The committed docs page: the diagram in a fenced Mermaid block, then the guard's table."""
    return (
        "# torpor state diagram\n\n"
        "Generated from `torpor/statemachine/core/states.py` by `torpor diagram`; "
        "a test fails when this file is stale.\n\n"
        "```mermaid\n" + mermaid() + "```\n\n"
        "## The guard\n\n"
        "Every command is checked against this table and nothing else (`decide(state, command)`): "
        "where an accepted command leads (a transitional state is ended by the controller's own step "
        "above), or the error a refused one raises. A refusal is recorded as a `refused` event and "
        "changes nothing. The arguments (level, tags, host budget, the pool's holders) are checked by "
        "the command once the state allows it.\n\n" + guard_table()
    )
