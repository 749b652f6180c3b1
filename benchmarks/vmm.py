"""The CUDA VMM calls from Python through cuda-bindings, for benchmarks and probes that time them bare.

torpor makes these calls in one place, its native library (torpor/allocator/native/csrc/driver_cuda.c);
this helper is what a benchmark compares that with, or what a probe needs to ask the driver a question
directly (``release_cost.py``, ``probes/probe_unmap.py``, ``probes/probe_release_overlap.py``). Each
device gets its retained primary context made current when a thread has none, as the library does.
A probe in ``probes/`` puts this folder on ``sys.path`` first.
"""

from __future__ import annotations

from typing import Any

from torpor.allocator.native.cuda_driver import CudaDriver, _cu
from torpor.errors import DriverError, DriverOutOfMemory


class Vmm:
    """cuMemAddressReserve/Create/Map/SetAccess/Unmap/Release/AddressFree on device memory (pinned, read-write)."""

    def __init__(self) -> None:
        self.cu = _cu()
        self._ctx: dict[int, Any] = {}
        self._props: dict[int, Any] = {}
        self.check("cuInit", self.cu.cuInit(0))

    def check(self, call: str, result: Any) -> Any:
        """Unpack a cuda-bindings result tuple; raise a DriverError (out of memory: DriverOutOfMemory) on failure."""
        cu = self.cu
        err = result[0]
        if err != cu.CUresult.CUDA_SUCCESS:
            _, name = cu.cuGetErrorName(err)
            _, text = cu.cuGetErrorString(err)
            label = name.decode() if isinstance(name, bytes) else str(name)
            detail = text.decode() if isinstance(text, bytes) else str(text)
            cls = DriverOutOfMemory if int(err) == 2 else DriverError
            raise cls(call, f"{label}: {detail}", int(err))
        if len(result) == 1:
            return None
        return result[1] if len(result) == 2 else result[1:]

    def ensure_context(self, device: int) -> None:
        """Make ``device``'s primary context current in this thread when no context is."""
        cu = self.cu
        ctx = self._ctx.get(device)
        if ctx is None:
            dev = self.check("cuDeviceGet", cu.cuDeviceGet(device))
            ctx = self._ctx[device] = self.check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(dev))
        current = self.check("cuCtxGetCurrent", cu.cuCtxGetCurrent())
        if current is None or int(current) == 0:
            self.check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))

    def prop(self, device: int) -> Any:
        """The allocation properties of ``device`` (pinned device memory); a benchmark may set flags on them."""
        prop = self._props.get(device)
        if prop is None:
            cu = self.cu
            prop = cu.CUmemAllocationProp()
            prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = device
            self._props[device] = prop
        return prop

    def granularity(self, device: int) -> int:
        """The recommended mapping granularity of ``device``."""
        self.ensure_context(device)
        flag = self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(
            self.check("cuMemGetAllocationGranularity", self.cu.cuMemGetAllocationGranularity(self.prop(device), flag))
        )

    def reserve(self, nbytes: int, device: int) -> int:
        """Reserve ``nbytes`` of device address space; its start."""
        self.ensure_context(device)
        align = self.granularity(device)
        return int(self.check("cuMemAddressReserve", self.cu.cuMemAddressReserve(nbytes, align, 0, 0)))

    def unreserve(self, address: int, nbytes: int) -> None:
        """Free a reservation."""
        self.check("cuMemAddressFree", self.cu.cuMemAddressFree(address, nbytes))

    def create(self, nbytes: int, device: int, prop: Any = None) -> Any:
        """Create ``nbytes`` of device memory (with ``prop``, else the device's); its handle."""
        self.ensure_context(device)
        return self.check("cuMemCreate", self.cu.cuMemCreate(nbytes, prop or self.prop(device), 0))

    def map(self, address: int, nbytes: int, handle: Any) -> None:
        """Map a whole handle at ``address``."""
        self.check("cuMemMap", self.cu.cuMemMap(address, nbytes, 0, handle, 0))

    def set_access(self, address: int, nbytes: int, device: int) -> None:
        """Make a mapped range readable and writable from ``device``."""
        cu = self.cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.check("cuMemSetAccess", cu.cuMemSetAccess(address, nbytes, [desc], 1))

    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap a range (the handle stays alive)."""
        self.check("cuMemUnmap", self.cu.cuMemUnmap(address, nbytes))

    def release(self, handle: Any) -> None:
        """Release a handle (its memory goes once it is unmapped everywhere)."""
        self.check("cuMemRelease", self.cu.cuMemRelease(handle))


class VmmDriver(CudaDriver):
    """torpor's CudaDriver (host memory, copies, events: the native library) with :class:`Vmm`'s bare VMM calls beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.vmm = Vmm()

    def reserve(self, nbytes: int, device: int) -> int:
        """Reserve ``nbytes`` of device address space; its start."""
        return self.vmm.reserve(nbytes, device)

    def unreserve(self, address: int, nbytes: int) -> None:
        """Free a reservation."""
        self.vmm.unreserve(address, nbytes)

    def create(self, nbytes: int, device: int) -> Any:
        """Create ``nbytes`` of device memory; its handle."""
        return self.vmm.create(nbytes, device)

    def map(self, address: int, nbytes: int, handle: Any) -> None:
        """Map a whole handle at ``address``."""
        self.vmm.map(address, nbytes, handle)

    def set_access(self, address: int, nbytes: int, device: int) -> None:
        """Make a mapped range readable and writable from ``device``."""
        self.vmm.set_access(address, nbytes, device)

    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap a range."""
        self.vmm.unmap(address, nbytes)

    def release(self, handle: Any) -> None:
        """Release a handle."""
        self.vmm.release(handle)
