"""Keeping chosen ranges of a tag across a discard: the ranges, the torch module tracker, the allocator's keep calls.

It owns :mod:`.ranges` (what a keep source names), :mod:`.modules`
(``ModuleTracker``: what no ``state_dict`` reload restores) and :mod:`.keeping`
(``KeepBook``: the part of ``TaggedAllocator`` called around the sleep/wake
cycle's release and restore). It imports the native, host and sleep-and-wake
layers below it; never the torch pools or ``TaggedAllocator``, nor the
controller, hooks or telemetry.
"""
