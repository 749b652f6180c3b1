"""The machine: commands guarded against the projection, planned per tag, carried out on the memory, recorded as events.

It owns :class:`~torpor.statemachine.machine.controller.SleepController`, one
class holding the commands, and the parts it is composed of, each with its own
state (docs/architecture.md, "The controller's parts"): :mod:`.recorder` (events
from typed payloads: log, projection, subscribers), :mod:`.gate` (one command at
a time, the guard, refusals), :mod:`.hostmem` (the host-memory policy's side),
:mod:`.group` and :mod:`.localgroup` (all-or-nothing groups), :mod:`.identity`
(the engine and rank, the log's file); and the steps, functions of one
:mod:`.context`: :mod:`.sleeping`, :mod:`.waking`, :mod:`.discarding`,
:mod:`.graphs`, :mod:`.tracking`, :mod:`.recovery` and :mod:`.rollback`.
It imports the core, the projection and the log below it; never the allocator,
hooks, telemetry or torch (a torch process group is adapted by a higher layer and
handed down: :func:`~torpor.statemachine.machine.group.adapt_groups`).
"""
