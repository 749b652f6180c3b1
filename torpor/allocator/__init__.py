"""torpor.allocator: a tagged cuMem allocator with an offloadable CUDA-graph pool and a native allocation path.

``TaggedAllocator(driver=None)`` (None: the CUDA driver) meets the memory
protocol the :class:`~torpor.SleepController` drives; its allocation table and
torch's malloc/free live in a small C library (:mod:`torpor.allocator.native.library`).
``SimDriver`` is that library's simulated device on host memory, with fault
injection. Importing this package touches neither CUDA, torch, nor the library.

Its parts, lowest first, each importing only those before it: :mod:`.native`
(the C library, its table and drivers), :mod:`.host` (pinned host memory),
:mod:`.sleepwake` (backup, release, restore), :mod:`.kept_ranges` (ranges kept across a
discard), :mod:`.torchside` (torch's pools), :mod:`.views` (what the allocator shows of
its parts), :mod:`.routing` and :mod:`.rawpath` (the pool blocks and the raw path) and
:mod:`.tagged` (``TaggedAllocator``, which owns them all).

This package is the one way in: code outside it imports the names below, never a module
under it, and reads an allocator through its public methods, properties and views
(tests/test_architecture.py checks both; docs/architecture.md, "The allocator's parts").
"""

from __future__ import annotations

from torpor.allocator.host.offload import HostArena, HostPolicy
from torpor.allocator.host.provider import HostProvider
from torpor.allocator.kept_ranges.ranges import KeepSource, KeptRange
from torpor.allocator.native.cuda_driver import CudaDriver, transparent_huge_pages
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.libc import libc
from torpor.allocator.native.sim_driver import SimCall, SimDriver
from torpor.allocator.sleepwake.sealing import WakeChecks
from torpor.allocator.tagged import GRAPH_TAG, TaggedAllocator
from torpor.allocator.torchside.graphpool import GraphPool
from torpor.allocator.views import BackupView, HostSpan, NativeEntry, SlabStats
from torpor.errors import AllocatorError, AllocatorOutOfMemory, DriverError, DriverOutOfMemory
from torpor.graphcapture import CaptureHandle, CaptureObserver, CaptureObservers

__all__ = [
    "GRAPH_TAG",
    "AllocatorError",
    "AllocatorOutOfMemory",
    "BackupView",
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
    "HostProvider",
    "HostSpan",
    "KeepSource",
    "KeptRange",
    "NativeEntry",
    "SimCall",
    "SimDriver",
    "SlabStats",
    "TaggedAllocator",
    "WakeChecks",
    "libc",
    "transparent_huge_pages",
]
