"""Sleep and wake over the native table: copy plans, the per-tag records, the release and its undo.

It owns :mod:`.cycle` (``SleepWake``, a part of ``TaggedAllocator``: back up,
release, map back, restore; ``TorchSide``, what it is handed of the torch side),
:mod:`.plan` (backup extents, batches, wake spans), :mod:`.tagbook` (each tag's
record, ``TagState``, and the lock they share) and :mod:`.undo` (undoing a failed
release: plain functions of the driver, the table and the host arena). It
imports the native and host layers below it; never the keep ranges, the torch
side or ``TaggedAllocator`` above it, nor the controller, hooks or telemetry.
"""
