"""The simulated device's VMM calls from Python, for tests of the simulator's own rules and of memory taken outside.

The allocator makes VMM calls only in C (its table, csrc/table.c); torpor has no Python VMM calls.
These go straight to the simulator's exports (``tp_sim_reserve`` ...) through a ctypes handle of
their own, and raise the driver's error as the view does.
"""

from __future__ import annotations

import ctypes
import functools

from torpor.allocator.native import library as native
from torpor.allocator.native.driver import driver_error
from torpor.allocator.native.sim_driver import SimDriver

_u64, _p, _int = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int
_U, _E = ctypes.POINTER(_u64), ctypes.POINTER(native.TpErr)
_SIGNATURES = {
    "tp_sim_reserve": [_p, _int, _u64, _U, _E],
    "tp_sim_unreserve": [_p, _u64, _u64, _E],
    "tp_sim_create": [_p, _int, _u64, _U, _E],
    "tp_sim_map": [_p, _u64, _u64, _u64, _E],
    "tp_sim_set_access": [_p, _u64, _u64, _int, _E],
    "tp_sim_unmap": [_p, _u64, _u64, _E],
    "tp_sim_release": [_p, _u64, _E],
}


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(native.library_path()))  # the same library, with its own function objects
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = _int, argtypes
    return lib


class SimVmm:
    """VMM calls on ``sim``'s device (logged and failable like the table's: ``sim.fail("create")``)."""

    def __init__(self, sim: SimDriver) -> None:
        self.sim = sim

    def _call(self, name: str, *args: int, out: bool = False) -> int:
        err, value = native.TpErr(), _u64()
        extra = [ctypes.byref(value)] if out else []
        if getattr(_lib(), "tp_sim_" + name)(self.sim.native_sim, *args, *extra, ctypes.byref(err)) != 0:
            raise driver_error(err, name)
        return int(value.value)

    def reserve(self, nbytes: int, device: int) -> int:
        """Reserve ``nbytes`` of device address space; its start."""
        return self._call("reserve", device, nbytes, out=True)

    def unreserve(self, address: int, nbytes: int) -> None:
        """Free a reservation (no mapping may be left in it)."""
        self._call("unreserve", address, nbytes)

    def create(self, nbytes: int, device: int) -> int:
        """Create ``nbytes`` of device memory; its handle."""
        return self._call("create", device, nbytes, out=True)

    def map(self, address: int, nbytes: int, handle: int) -> None:
        """Map a whole handle at ``address`` inside a reservation."""
        self._call("map", address, nbytes, handle)

    def set_access(self, address: int, nbytes: int, device: int) -> None:
        """Make a mapped range readable and writable."""
        self._call("set_access", address, nbytes, device)

    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap a whole mapping."""
        self._call("unmap", address, nbytes)

    def release(self, handle: int) -> None:
        """Release a handle (its memory goes once it is unmapped)."""
        self._call("release", handle)
