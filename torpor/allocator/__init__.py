"""torpor.allocator: a tagged cuMem allocator with an offloadable CUDA-graph pool and a native allocation path.

``TaggedAllocator(driver=None)`` (None: the CUDA driver) meets the memory
protocol the :class:`~torpor.SleepController` drives; its allocation table and
torch's malloc/free live in a small C library (:mod:`torpor.allocator.native.library`).
``SimDriver`` is that library's simulated device on host memory, with fault
injection. Importing this package touches neither CUDA, torch, nor the library.

Its parts, lowest first, each importing only those before it: :mod:`.native`
(the C library, its table and drivers), :mod:`.host` (pinned host memory),
:mod:`.sleepwake` (backup, release, restore), :mod:`.kept_ranges` (ranges kept across a
discard), :mod:`.torchside` (torch's pools) and :mod:`.tagged` (``TaggedAllocator``).
"""

from __future__ import annotations

from torpor.allocator.host.offload import HostArena, HostPolicy
from torpor.allocator.native.cuda_driver import CudaDriver
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.sim_driver import SimCall, SimDriver
from torpor.allocator.tagged import GRAPH_TAG, TaggedAllocator
from torpor.allocator.torchside.graphpool import GraphPool
from torpor.errors import AllocatorError, AllocatorOutOfMemory, DriverError, DriverOutOfMemory
from torpor.graphcapture import CaptureHandle, CaptureObserver, CaptureObservers

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
