"""The torch side of the allocator: torch's pluggable allocators and memory pools per tag, pool trimming, the graph pool.

It owns :mod:`.pools` (``TorchPools``), :mod:`.binding` (made at the first use on
CUDA), :mod:`.trim` (reusing and trimming block pools), :mod:`.graphpool` and
:mod:`.graphstate` (the CUDA-graph pool over its generations). torch is imported
only inside functions. It reads the allocator through a protocol
(:class:`~torpor.allocator.torchside.pools.AllocatorParts`) and never imports
``TaggedAllocator``, the controller, hooks or telemetry.
"""
