"""What the command steps share: one context over the memory, the policy and the controller's parts.

The steps (:mod:`~torpor.statemachine.machine.sleeping`,
:mod:`~torpor.statemachine.machine.waking`,
:mod:`~torpor.statemachine.machine.discarding`,
:mod:`~torpor.statemachine.machine.graphs`,
:mod:`~torpor.statemachine.machine.rollback`,
:mod:`~torpor.statemachine.machine.recovery`,
:mod:`~torpor.statemachine.machine.tracking`) are functions of a
:class:`Context`; it holds no state of its own but the group, which the vLLM
backend may set after the controller is made. A step calls the parts it is
handed itself (``ctx.recorder.record``, ``ctx.gate.refuse``); the context adds
what no part holds: the memory's usage as event fields, the tag check, the
group's vote. It is also what a group runs its votes through
(:class:`~torpor.statemachine.machine.group.Participant`: ``state``,
``record``, ``refuse``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from torpor.errors import TorporError, UnknownTag
from torpor.statemachine.core.events import Event
from torpor.statemachine.core.fields import Payload
from torpor.statemachine.core.policy import Policy
from torpor.statemachine.core.protocol import Abilities, Memory
from torpor.statemachine.core.states import State
from torpor.statemachine.machine.gate import Gate
from torpor.statemachine.machine.group import GroupMember
from torpor.statemachine.machine.hostmem import HostSide
from torpor.statemachine.machine.recorder import Recorder
from torpor.statemachine.projection.view import Projection


def _tag_list(tags: Sequence[str] | str) -> list[str]:
    """Tags as a list without repeats; one tag may be given as a plain string."""
    return list(dict.fromkeys([tags] if isinstance(tags, str) else tags))


@dataclass
class Context:
    """The memory and its abilities, the policy, the parts that record, refuse and keep host memory, and the group."""

    memory: Memory
    abilities: Abilities
    policy: Policy
    host: HostSide
    recorder: Recorder
    gate: Gate
    group: GroupMember | None = None

    @property
    def projection(self) -> Projection:
        """The recorder's projection: the state and each tag's residency."""
        return self.recorder.projection

    @property
    def state(self) -> State:
        """The current state (see docs/architecture.md "Invariant: the state is the projection's")."""
        return self.recorder.projection.state

    def record(self, payload: Payload) -> Event:
        """Record a group's vote (:meth:`Recorder.record`; a step calls ``ctx.recorder.record`` itself)."""
        return self.recorder.record(payload)

    def refuse(self, command: str, error: TorporError) -> NoReturn:
        """Record a group's refusal and raise ``error`` (:meth:`Gate.refuse`; a step calls ``ctx.gate.refuse`` itself)."""
        self.gate.refuse(command, error)

    def resident_usage(self) -> dict[str, int]:
        """The memory's resident bytes per tag, as an event field."""
        return {tag: u.resident for tag, u in self.memory.usage().items()}

    def allocation_counts(self) -> dict[str, int]:
        """The memory's allocations per tag, as an event field."""
        return {tag: u.allocations for tag, u in self.memory.usage().items()}

    def check_tags(self, command: str, tags: Sequence[str]) -> None:
        """Refuse ``command`` (``UnknownTag``) when a tag is neither in the projection nor in the memory."""
        known = set(self.projection.residency) | set(self.memory.usage())
        unknown = [t for t in tags if t not in known]
        if unknown:
            self.gate.refuse(command, UnknownTag(unknown, known))

    def hold(self, undo: Callable[[TorporError], None] | None) -> None:
        """With a group: the local part is prepared; vote, and ``undo`` it (then raise) when a rank failed."""
        if self.group is not None:
            self.group.hold(self, undo)
