"""The native allocation table and its drivers: the C library (csrc/), its ctypes binding and the driver tables.

It owns :mod:`.library` (loading ``libtorpor_alloc.so``), :mod:`.table`
(``NativeTable``: allocations, mappings, slabs, tag states), :mod:`.driver` (the
driver interface), :mod:`.cuda_driver` (the CUDA driver API), :mod:`.sim` (a
simulated device) and :mod:`.headroom` (how much host memory can still be faulted
in). Mechanism only: it imports nothing of the allocator above it (host memory,
sleep and wake, torch), nothing of the controller, hooks or telemetry, and no torch.
"""
