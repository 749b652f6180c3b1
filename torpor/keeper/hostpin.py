"""Pinning kept regions for copies to one GPU: ``cuMemHostRegister`` from any thread, without holding the GIL.

Why not ``torch.cuda.cudart().cudaHostRegister``: torch's binding holds the
GIL for the whole call. An adoption's pinning threads then registered one at a
time, and the thread that queued them waited behind each registration (on the
H200, queueing the pins of a 15 GB backup took 0.6 s of a 1.26 s adoption,
benchmarks/probes/probe_adopt_pinning.py); pinning in the background while a
model is built would stall the build the same way. The driver's own entry
points through ctypes release the GIL. Each call is made with ``device``'s
primary context current in the calling thread (a pool thread has none, and a
rank on GPU 1 must not make a context on GPU 0); the context is retained while
this object lives and released by :meth:`HostPinning.close`. Registrations
are portable (every context may copy from them: a model may span GPUs).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from torpor.errors import PinningUnavailable

__all__ = ["HostPinning"]

_PORTABLE = 1  # CU_MEMHOSTREGISTER_PORTABLE
_opened: list[Any] = []  # the library, once opened
_lib_lock = threading.Lock()


def _libcuda() -> Any:
    """The CUDA driver library, opened once (``libcuda.so.1``)."""
    with _lib_lock:
        if not _opened:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                msg = f"the CUDA driver (libcuda.so.1) cannot be opened: {exc}"
                raise PinningUnavailable(msg) from exc
            lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            _opened.append(lib)
        return _opened[0]


class HostPinning:
    """Register and unregister host ranges for ``device`` (a CUDA ordinal) from any thread; :meth:`close` when done."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._cu = _libcuda()
        self._dev = ctypes.c_int()
        self._ctx = ctypes.c_void_p()
        for call, args in (
            ("cuInit", (0,)),
            ("cuDeviceGet", (ctypes.byref(self._dev), device)),
            ("cuDevicePrimaryCtxRetain", (ctypes.byref(self._ctx), self._dev)),
        ):
            err = int(getattr(self._cu, call)(*args))
            if err != 0:
                msg = f"{call} for GPU {device} failed with CUDA error {err}: kept regions cannot be pinned"
                raise PinningUnavailable(msg)
        self._closed = False

    def pin(self, address: int, nbytes: int) -> bool:
        """Register ``[address, address + nbytes)`` (page-aligned, mapped); whether it is pinned now."""
        if self._cu.cuCtxSetCurrent(self._ctx) != 0:
            return False
        return int(self._cu.cuMemHostRegister_v2(address, nbytes, _PORTABLE)) == 0

    def unpin(self, address: int, _nbytes: int) -> int:
        """Unregister a range :meth:`pin` registered (by its start); the CUDA error (0: done)."""
        err = int(self._cu.cuCtxSetCurrent(self._ctx))
        return err or int(self._cu.cuMemHostUnregister(address))

    def close(self) -> None:
        """Release the retained primary context (after every :meth:`unpin`); idempotent."""
        if not self._closed:
            self._closed = True
            self._cu.cuDevicePrimaryCtxRelease_v2(self._dev)
