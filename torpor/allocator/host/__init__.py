"""Host memory for backups: pinned chunks, the arena that offloads a tag's bytes, and the staged copies.

It owns :mod:`.chunks` (pinned host chunks), :mod:`.pinning` (pinning and faulting
them in), :mod:`.offload` (``HostArena`` and ``HostPolicy``) and :mod:`.staging`
(copies through a staging buffer). It imports the native layer (the driver) and
nothing above it: no sleep-and-wake planning, no torch, no controller, hooks or telemetry.
"""
