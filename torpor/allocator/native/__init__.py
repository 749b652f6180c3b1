"""The native allocation table and its drivers: the C library (csrc/), its ctypes binding and the driver tables.

It owns :mod:`.library` (loading ``libtorpor_alloc.so``), :mod:`.table`
(``NativeTable``: allocations, mappings, slabs, tag states), :mod:`.driver` (the
Python view of the library's driver table: host memory, copies, events), its two
views :mod:`.cuda_driver` (the CUDA driver, opened once by the library) and
:mod:`.sim` (a simulated device), :mod:`.headroom` (how much host memory can still
be faulted in) and :mod:`.libc` (typed libc memory calls). The VMM calls are made in
C only (csrc/driver_cuda.c); no module here makes one. Mechanism only: it imports nothing of the allocator above it (host memory,
sleep and wake, torch), nothing of the controller, hooks or telemetry, and no torch.
"""
