"""Sleep and wake over the native table: copy plans, the per-tag records, the release and its undo.

It owns :mod:`.cycle` (``SleepWake``: back up, release, map back, restore),
:mod:`.plan` (backup extents, batches, wake spans), :mod:`.tagbook` (each tag's
record and the lock they share) and :mod:`.undo` (undoing a failed release). It
imports the native and host layers below it; never the keep ranges, the torch
side or ``TaggedAllocator`` above it, nor the controller, hooks or telemetry.
"""
