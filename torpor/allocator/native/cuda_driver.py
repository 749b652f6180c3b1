"""CudaDriver: the view of the native library's CUDA driver table (csrc/driver_cuda.c), and host pages for backups.

CUDA is opened once, by the library (``dlopen`` of libcuda); nothing touches it until the first call,
so ``import torpor.allocator`` and ``CudaDriver()`` work on a machine without a GPU. Each device gets
its retained primary context and one non-blocking copy stream; a thread with no current context gets
the primary context of the device it works on (callbacks run on threads torch picks). Copies are
enqueued on the copy stream and waited for through an event recorded after them (timing disabled);
pinned host memory is faulted in by the calling thread and registered portable (``cuMemHostRegister``).

The host-page helpers below (reserve, fault in, free; the kernel's huge page mode) are the library's
own (csrc/hostpages.c), for the probes and tests that time or check them alone.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from typing import Any, Literal

from torpor.allocator.native import library as native
from torpor.allocator.native.driver import Driver, driver_error
from torpor.allocator.native.library import check_length, check_range
from torpor.extras import require

_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_PAGE = mmap.PAGESIZE


def _cu() -> Any:
    """cuda-bindings' driver module (torch-side helpers that query CUDA state); the allocator's calls go to the library."""
    return require("cuda.bindings.driver", "the CUDA driver (CudaDriver, TaggedAllocator on a GPU)")


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or ``unavailable``."""
    try:
        with open(_THP) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip() or "unavailable"


def _pages(call: str, fn: str, *args: Any) -> None:
    err = native.TpErr()
    if getattr(native.lib(), fn)(*args, ctypes.byref(err)) != 0:
        raise driver_error(err, call)


def reserve_host_pages(nbytes: int) -> int:
    """Anonymous private address space of ``nbytes``, 2 MiB aligned, huge pages advised; nothing faulted in yet.

    Where the kernel has no transparent huge pages (or they are ``never``) the
    advice does nothing and the pages are 4 KiB: slower to fault in, same result.
    """
    out = ctypes.c_uint64()
    _pages("mmap", "tp_host_pages_reserve", check_length(nbytes, "reserve_host_pages", least=1), ctypes.byref(out))
    return int(out.value)


FaultMethod = Literal["written", "populated", "zero-filled"]
_METHODS: dict[int, FaultMethod] = {1: "written", 2: "populated", 3: "zero-filled"}


def fault_host_pages(address: int, nbytes: int, write: bool) -> FaultMethod:
    """Fault never-written pages in: by writing zeros (``write``: the host has room), else by populating.

    Writing faulted fresh pages 5-10x faster than ``MADV_POPULATE_WRITE`` on the H200 guest
    (benchmarks/probes/probe_fault_method.py), but a write fault with no memory under a cgroup
    limit calls the OOM killer where populating fails with ENOMEM
    (:mod:`torpor.allocator.native.headroom`; :meth:`Driver.host_room
    <torpor.allocator.native.driver.Driver.host_room>` says which). Never for pages that hold
    data: both ways leave zeros on kernels without ``MADV_POPULATE_WRITE`` (then ``zero-filled``).
    What :meth:`CudaDriver.host_alloc` does before it registers the pages.
    """
    how = ctypes.c_int()
    address, nbytes = check_range(address, nbytes, "fault_host_pages", what="host")
    _pages("madvise", "tp_host_pages_fault", address, nbytes, int(write), ctypes.byref(how))
    return _METHODS[how.value]


def populate_host_pages(address: int, nbytes: int) -> None:
    """Fault ``nbytes`` at ``address`` in, writable (MADV_POPULATE_WRITE; on older kernels by writing zeros)."""
    fault_host_pages(address, nbytes, write=False)


def free_host_pages(address: int, nbytes: int) -> None:
    """Unmap host pages from :func:`reserve_host_pages` (any page-aligned piece of them)."""
    _pages("munmap", "tp_host_pages_free", *check_range(address, nbytes, "free_host_pages", what="host"))


def host_page_methods(huge_pages: bool | None = None, populate: bool | None = None) -> tuple[bool, bool]:
    """Turn huge page advice and ``MADV_POPULATE_WRITE`` on or off (None: as is), as on older kernels; the previous two.

    Populating turns itself off at the first kernel that refuses it (before 5.14).
    """
    was_huge, was_populate = ctypes.c_int(), ctypes.c_int()
    native.lib().tp_host_pages_methods(
        -1 if huge_pages is None else int(huge_pages),
        -1 if populate is None else int(populate),
        ctypes.byref(was_huge),
        ctypes.byref(was_populate),
    )
    return bool(was_huge.value), bool(was_populate.value)


class CudaDriver(Driver):
    """The real device: the library's CUDA driver table (cuMemcpy*Async on a copy stream, events, cuMemHostRegister)."""

    name = "cuda"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._driver: int | None = None
        self.lib = None

    def _table(self) -> int:
        """The CUDA driver table, opened (dlopen, cuInit) on the first call.

        The GPU path needs the ``cuda`` extra (torch and cuda-bindings: the torch side queries
        capture state with it), so a first call without it raises MissingExtra naming it, as before
        the driver's calls moved into the library.
        """
        table = self._driver
        if table is None:
            _cu()
            with self._lock:
                if self._driver is None:
                    lib = native.lib()
                    err = native.TpErr()
                    opened = lib.tp_drv_cuda(ctypes.byref(err))
                    if not opened:
                        raise driver_error(err, "cuInit")
                    if self.lib is None:
                        self.lib = lib
                    self._driver = int(opened)
                    self._ready = True
                table = self._driver
        return table

    def _host_alloc(self, nbytes: int, host: int | None) -> int:
        """Pinned host memory: faulted in by this thread (by writing where the host has room), then registered.

        Not ``cuMemHostAlloc``: it holds the driver's lock while the pages are
        made, which stalled every CUDA call of the engine for the whole pinning
        time on the H200 here (benchmarks/probes/probe_pinning.py); pages faulted in
        first (by several threads at once in a sleep) are registered quickly,
        holding the lock briefly per chunk.
        """
        return self._pin(nbytes, host, write=self.host_room(-(-nbytes // _PAGE) * _PAGE))
