"""The states and the transition table, as data, and the Mermaid diagram drawn from it.

The table is the one place the lifecycle is declared; the controller builds its
``transitions.Machine`` from it and the docs' diagram is generated from it
(``torpor diagram``; a test keeps ``docs/state-diagram.md`` current).
"""

from __future__ import annotations

import enum
from typing import Any


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

#: The transition table. ``trigger`` is the command (or internal step),
#: ``dest`` None marks an internal transition (a guarded command that does not
#: change the state). ``conditions`` name predicates of the controller's model.
TRANSITIONS: list[dict[str, Any]] = [
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


def allowed_sources(trigger: str) -> tuple[str, ...]:
    """States from which ``trigger`` is accepted, in table order, without repeats."""
    seen: list[str] = []
    for row in TRANSITIONS:
        if row["trigger"] != trigger:
            continue
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        seen.extend(s for s in sources if s not in seen)
    return tuple(seen)


def mermaid() -> str:
    """The state diagram in Mermaid, generated from :data:`TRANSITIONS`."""
    lines = ["stateDiagram-v2", f"    [*] --> {A}"]
    for row in TRANSITIONS:
        sources = row["source"] if isinstance(row["source"], list) else [row["source"]]
        for src in sources:
            dest = row["dest"] or src
            guard = row.get("conditions") or (f"not {row['unless']}" if "unless" in row else "")
            label = row["trigger"] + (f" [{guard}]" if guard else "")
            lines.append(f"    {src} --> {dest}: {label}")
    return "\n".join(lines) + "\n"


def diagram_markdown() -> str:
    """The committed docs page: the diagram in a fenced Mermaid block."""
    return (
        "# torpor state diagram\n\n"
        "Generated from `torpor/statemachine/states.py` by `torpor diagram`; "
        "a test fails when this file is stale.\n\n"
        "```mermaid\n" + mermaid() + "```\n"
    )
