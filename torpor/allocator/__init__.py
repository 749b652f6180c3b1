"""torpor.allocator: a tagged cuMem allocator with an offloadable CUDA-graph pool and a native allocation path.

``TaggedAllocator(driver=None)`` (None: the CUDA driver) meets the memory
protocol the :class:`~torpor.SleepController` drives; its allocation table and
torch's malloc/free live in a small C library (:mod:`torpor.allocator.native`).
``SimDriver`` is that library's simulated device on host memory, with fault
injection. Importing this package touches neither CUDA, torch, nor the library.
"""

from __future__ import annotations

from torpor.allocator.cuda_driver import CudaDriver
from torpor.allocator.driver import Driver
from torpor.allocator.errors import AllocatorError, AllocatorOutOfMemory, DriverError, DriverOutOfMemory
from torpor.allocator.graphpool import CaptureHandle, CaptureObserver, CaptureObservers, GraphPool
from torpor.allocator.offload import HostArena, HostPolicy
from torpor.allocator.sim import SimCall, SimDriver
from torpor.allocator.tagged import GRAPH_TAG, TaggedAllocator

__all__ = [
    "GRAPH_TAG",
    "AllocatorError",
    "AllocatorOutOfMemory",
    "CaptureHandle",
    "CaptureObserver",
    "CaptureObservers",
    "CudaDriver",
    "Driver",
    "DriverError",
    "DriverOutOfMemory",
    "GraphPool",
    "HostArena",
    "HostPolicy",
    "SimCall",
    "SimDriver",
    "TaggedAllocator",
]
