"""The machine: commands guarded against the projection, planned per tag, carried out on the memory, recorded as events.

It owns :class:`~torpor.statemachine.machine.controller.SleepController` and the
parts it is composed of: :mod:`.base` (the controller's state, documented in
docs/architecture.md), :mod:`.gate` (the command gate), :mod:`.sleeping`,
:mod:`.waking`, :mod:`.discarding`, :mod:`.graphs`, :mod:`.lifecycle`,
:mod:`.tracking` (the commands), :mod:`.rollback` and :mod:`.hostmem` (undo and
host-memory checks), :mod:`.group` and :mod:`.localgroup` (all-or-nothing groups).
It imports the core, the projection and the log below it; never the allocator,
hooks, telemetry or torch (a torch process group is adapted by a higher layer and
handed down: :func:`~torpor.statemachine.machine.group.adapt_groups`).
"""
