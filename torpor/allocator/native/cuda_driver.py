"""CudaDriver: the CUDA driver's VMM, pinned-host and async-copy calls through ``cuda-bindings``.

Nothing touches CUDA until the first call: ``import torpor.allocator`` works on a
machine without a GPU. Each device gets its retained primary context and one
non-blocking copy stream; a thread with no current context gets the primary
context of the device it works on (callbacks run on threads torch picks).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

from torpor.allocator.errors import DriverError, DriverOutOfMemory
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.libc import libc as _libc
from torpor.extras import require

_OOM_CODES = frozenset({2})  # CUDA_ERROR_OUT_OF_MEMORY


def _cu() -> Any:
    return require("cuda.bindings.driver", "the CUDA driver (CudaDriver, TaggedAllocator on a GPU)")


_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without writing them
_HUGE = 2 << 20
_PAGE = mmap.PAGESIZE
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or ``unavailable``."""
    try:
        with open(_THP) as f:
            text = f.read()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else text.strip() or "unavailable"


def _round_pages(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


def reserve_host_pages(nbytes: int) -> int:
    """Anonymous private address space of ``nbytes``, 2 MiB aligned, huge pages advised; nothing faulted in yet.

    Where the kernel has no transparent huge pages (or they are ``never``) the
    advice does nothing and the pages are 4 KiB: slower to fault in, same result.
    """
    libc = _libc()
    size = _round_pages(nbytes)
    raw = libc.mmap(None, size + _HUGE, _PROT_READ_WRITE, _MAP_PRIVATE_ANONYMOUS, -1, 0)
    if raw is None or raw == _MAP_FAILED:
        err = ctypes.get_errno()
        reason = f"mapping {size} bytes of host memory failed: {os.strerror(err)}"
        if err == errno.ENOMEM:
            raise DriverOutOfMemory("mmap", reason, 2)
        raise DriverError("mmap", reason, err)
    address = -(-int(raw) // _HUGE) * _HUGE
    head, tail = address - int(raw), int(raw) + size + _HUGE - (address + size)
    if head:
        libc.munmap(int(raw), head)
    if tail:
        libc.munmap(address + size, tail)
    libc.madvise(address, size, _MADV_HUGEPAGE)  # EINVAL without THP support: 4 KiB pages then
    return address


_populate_works: list[bool] = [True]


def populate_host_pages(address: int, nbytes: int) -> None:
    """Fault ``nbytes`` at ``address`` in, writable (MADV_POPULATE_WRITE; on older kernels by writing zeros)."""
    libc = _libc()
    size = _round_pages(nbytes)
    if _populate_works[0]:
        if libc.madvise(address, size, _MADV_POPULATE_WRITE) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.ENOMEM, errno.EFAULT):
            raise DriverOutOfMemory("madvise", f"faulting in {size} host bytes failed: {os.strerror(err)}", 2)
        if err != errno.EINVAL:
            raise DriverError("madvise", f"faulting in {size} host bytes failed: {os.strerror(err)}", err)
        _populate_works[0] = False  # a kernel before 5.14
    libc.memset(address, 0, size)


def fault_host_pages(address: int, nbytes: int, room: Callable[[int], bool]) -> None:
    """Fault never-written pages in: by writing zeros where the host clearly has room, else by populating.

    Writing faulted fresh pages 5-10x faster than ``MADV_POPULATE_WRITE`` on the
    H200 guest (benchmarks/probes/probe_fault_method.py), but a write fault with no
    memory under a cgroup limit calls the OOM killer where populating fails
    with ENOMEM (:mod:`torpor.allocator.native.headroom`). Never for pages that hold
    data: both ways leave zeros on kernels without ``MADV_POPULATE_WRITE``.
    ``room(n)`` says whether ``n`` bytes fit with room to spare (and claims
    them): :meth:`Driver.host_room <torpor.allocator.native.driver.Driver.host_room>`.
    """
    size = _round_pages(nbytes)
    if room(size):
        _libc().memset(address, 0, size)
    else:
        populate_host_pages(address, size)


def free_host_pages(address: int, nbytes: int) -> None:
    """Unmap host pages from :func:`reserve_host_pages` (any page-aligned piece of them)."""
    if _libc().munmap(address, _round_pages(nbytes)) != 0:
        err = ctypes.get_errno()
        raise DriverError("munmap", f"unmapping {nbytes} host bytes at {address:#x} failed: {os.strerror(err)}", err)


class CudaDriver(Driver):
    """The real device: cuMemAddressReserve/Create/Map/SetAccess/Unmap/Release, cuMemHostAlloc, cuMemcpy*Async."""

    name = "cuda"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._ctx: dict[int, Any] = {}
        self._streams: dict[int, Any] = {}
        self._props: dict[int, Any] = {}
        self._access: dict[int, list[Any]] = {}
        self._gran: dict[int, int] = {}
        self._host_sizes: dict[int, int] = {}

    def _check(self, call: str, result: Any) -> Any:
        """Unpack a cuda-bindings result tuple; raise a DriverError on a failed call."""
        cu = _cu()
        err = result[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            code = int(err)
            _, name = cu.cuGetErrorName(err)
            _, text = cu.cuGetErrorString(err)
            label = name.decode() if isinstance(name, bytes) else str(name)
            detail = text.decode() if isinstance(text, bytes) else str(text)
            cls = DriverOutOfMemory if code in _OOM_CODES else DriverError
            raise cls(call, f"{label}: {detail}", code)
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def _init(self) -> None:
        if self._ready:
            return
        with self._lock:
            if not self._ready:
                self._check("cuInit", _cu().cuInit(0))
                self._ready = True

    def _device_ctx(self, device: int) -> Any:
        ctx = self._ctx.get(device)
        if ctx is None:
            self._init()
            cu = _cu()
            with self._lock:
                ctx = self._ctx.get(device)
                if ctx is None:
                    dev = self._check("cuDeviceGet", cu.cuDeviceGet(device))
                    ctx = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev))
                    self._ctx[device] = ctx
        return ctx

    def ensure_context(self, device: int) -> None:
        """Make ``device``'s primary context current in this thread when no context is."""
        cu = _cu()
        ctx = self._device_ctx(device)
        current = self._check("cuCtxGetCurrent", cu.cuCtxGetCurrent())
        if current is None or int(current) == 0:
            self._check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))

    def prepare_device(self, device: int) -> None:
        """The device's context and copy stream, made now: a stream holds a little device memory, and one made
        during a sleep would stay on the device while it is asleep (the native library maps memory, not this class)."""
        self._stream(device)

    def _host_device(self) -> int:
        """The device whose context pinned-memory calls use when a thread has none: the first one worked on (else 0).

        A process driving GPU 1 (one rank of several) must not create a context
        on GPU 0 just to pin host memory (it would take device memory there).
        """
        with self._lock:
            return next(iter(self._ctx), 0)

    def prepare_thread(self) -> None:
        """Primary context current, and relaxed capture mode: pinning here must not break a capture in another thread."""
        cu = _cu()
        self.ensure_context(self._host_device())
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        self._check("cuThreadExchangeStreamCaptureMode", cu.cuThreadExchangeStreamCaptureMode(mode))

    def use_device(self, device: int) -> Any:
        """Make ``device``'s primary context current; return the previous one (for :meth:`restore_context`)."""
        cu = _cu()
        ctx = self._device_ctx(device)
        current = self._check("cuCtxGetCurrent", cu.cuCtxGetCurrent())
        if current is None or int(current) != int(ctx):
            self._check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
        return current

    def restore_context(self, previous: Any) -> None:
        """Make ``previous`` (from :meth:`use_device`) current again."""
        if previous is not None and int(previous) != 0:
            cu = _cu()
            self._check("cuCtxSetCurrent", cu.cuCtxSetCurrent(previous))

    def _stream(self, device: int) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            cu = _cu()
            self.ensure_context(device)
            flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
            stream = self._check("cuStreamCreate", cu.cuStreamCreate(flags))
            self._streams[device] = stream
        return stream

    def _prop(self, device: int) -> Any:
        prop = self._props.get(device)
        if prop is None:
            cu = _cu()
            prop = cu.CUmemAllocationProp()
            prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = device
            self._props[device] = prop
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = device
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access[device] = [desc]
        return prop

    # -- the calls --------------------------------------------------------------------

    def _granularity(self, device: int) -> int:
        gran = self._gran.get(device)
        if gran is None:
            cu = _cu()
            self._device_ctx(device)
            flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
            gran = int(
                self._check("cuMemGetAllocationGranularity", cu.cuMemGetAllocationGranularity(self._prop(device), flag))
            )
            self._gran[device] = gran
        return gran

    def _reserve(self, nbytes: int, device: int) -> int:
        self.ensure_context(device)
        self._stream(device)  # made now, not during a sleep: a stream holds a little device memory
        ptr = self._check("cuMemAddressReserve", _cu().cuMemAddressReserve(nbytes, self._granularity(device), 0, 0))
        return int(ptr)

    def _unreserve(self, address: int, nbytes: int) -> None:
        self._check("cuMemAddressFree", _cu().cuMemAddressFree(address, nbytes))

    def _create(self, nbytes: int, device: int) -> object:
        self.ensure_context(device)
        return self._check("cuMemCreate", _cu().cuMemCreate(nbytes, self._prop(device), 0))

    def _map(self, address: int, nbytes: int, handle: object) -> None:
        self._check("cuMemMap", _cu().cuMemMap(address, nbytes, 0, handle, 0))

    def _set_access(self, address: int, nbytes: int, device: int) -> None:
        self._prop(device)
        self._check("cuMemSetAccess", _cu().cuMemSetAccess(address, nbytes, self._access[device], 1))

    def _unmap(self, address: int, nbytes: int) -> None:
        self._check("cuMemUnmap", _cu().cuMemUnmap(address, nbytes))

    def _release(self, handle: object) -> None:
        self._check("cuMemRelease", _cu().cuMemRelease(handle))

    def _host_reserve(self, nbytes: int) -> int:
        return reserve_host_pages(nbytes)

    def _host_alloc(self, nbytes: int, host: int | None) -> int:
        """Pinned host memory: faulted in by this thread (huge pages where allowed), then registered with the driver.

        Not ``cuMemHostAlloc``: it holds the driver's lock while the pages are
        made, which stalled every CUDA call of the engine for the whole pinning
        time on the H200 here (benchmarks/probes/probe_pinning.py); pages faulted in
        first (by several threads at once in a sleep) are registered quickly,
        holding the lock briefly per chunk.
        """
        address = reserve_host_pages(nbytes) if host is None else host
        try:
            self.ensure_context(self._host_device())
            fault_host_pages(address, nbytes, self.host_room)
            self._host_register(address, nbytes)
        except BaseException:
            if host is None:  # a reserved range stays reserved: its owner gives it back (host_unreserve)
                free_host_pages(address, nbytes)
            raise
        return address

    def _host_register(self, host: int, nbytes: int) -> None:
        """Register pages as they are (no populating: on old kernels that writes zeros over the data)."""
        cu = _cu()
        self.ensure_context(self._host_device())
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE
        self._check("cuMemHostRegister", cu.cuMemHostRegister(host, _round_pages(nbytes), flags))
        with self._lock:
            self._host_sizes[host] = nbytes

    def _host_free(self, host: int) -> None:
        self.ensure_context(self._host_device())
        self._check("cuMemHostUnregister", _cu().cuMemHostUnregister(host))
        with self._lock:
            nbytes = self._host_sizes.pop(host)
        free_host_pages(host, nbytes)

    def _host_unreserve(self, host: int, nbytes: int) -> None:
        free_host_pages(host, nbytes)

    def _copy_d2h(self, host: int, address: int, nbytes: int, device: int) -> None:
        self._check("cuMemcpyDtoHAsync", _cu().cuMemcpyDtoHAsync(host, address, nbytes, self._stream(device)))

    def _copy_h2d(self, address: int, host: int, nbytes: int, device: int) -> None:
        self._check("cuMemcpyHtoDAsync", _cu().cuMemcpyHtoDAsync(address, host, nbytes, self._stream(device)))

    def _record(self, device: int) -> object:
        cu = _cu()
        event = self._check("cuEventCreate", cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        self._check("cuEventRecord", cu.cuEventRecord(event, self._stream(device)))
        return event

    def _wait(self, event: object) -> None:
        cu = _cu()
        try:
            self._check("cuEventSynchronize", cu.cuEventSynchronize(event))
        finally:
            cu.cuEventDestroy(event)

    def _synchronize(self, device: int) -> None:
        previous = self.use_device(device)
        try:
            self._check("cuCtxSynchronize", _cu().cuCtxSynchronize())
        finally:
            self.restore_context(previous)

    def _mem_info(self, device: int) -> tuple[int, int]:
        previous = self.use_device(device)
        try:
            free, total = self._check("cuMemGetInfo", _cu().cuMemGetInfo())
        finally:
            self.restore_context(previous)
        return int(free), int(total)

    def read(self, address: int, nbytes: int) -> bytes:
        """Copy device bytes to a fresh host buffer (slow path for tests)."""
        cu = _cu()
        out = bytearray(nbytes)
        import ctypes

        buf = (ctypes.c_char * nbytes).from_buffer(out)
        self._check("cuMemcpyDtoH", cu.cuMemcpyDtoH(ctypes.addressof(buf), address, nbytes))
        return bytes(out)

    def write(self, address: int, data: bytes) -> None:
        """Copy host bytes to device memory (slow path for tests)."""
        cu = _cu()
        import ctypes

        buf = ctypes.create_string_buffer(data, len(data))
        self._check("cuMemcpyHtoD", cu.cuMemcpyHtoD(address, ctypes.addressof(buf), len(data)))
