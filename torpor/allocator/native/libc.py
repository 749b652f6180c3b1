"""The C library's memory calls through ctypes (mmap, munmap, madvise, memset), typed once for every Python caller.

The keeper's shared regions map and unmap host memory with them (the drivers' host memory is the
native library's own, csrc/hostpages.c and csrc/sim_host.c). Calls through it release the GIL.
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["libc"]


@functools.cache
def libc() -> ctypes.CDLL:
    """The process's C library, with ``mmap``, ``munmap``, ``madvise`` and ``memset`` typed (errno kept)."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.madvise.restype = ctypes.c_int
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.memset.restype = ctypes.c_void_p
    lib.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    return lib
