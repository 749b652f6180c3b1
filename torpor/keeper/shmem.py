"""Shared memory for the keeper: memfd regions the keeper creates and seals at their size, mapped by engines.

A region is an anonymous memfd (no path in any filesystem; only a process
holding its descriptor, or allowed to open ``/proc/<keeper>/fd``, reaches it),
sized once and sealed against growing and shrinking so that no mapping of it
can be cut short under a reader (SIGBUS). An engine maps it over the host range
its allocator reserved (:func:`map_over`, ``MAP_FIXED | MAP_SHARED``), an adopter
anywhere (:func:`map_anywhere`).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os

from torpor.allocator import libc as _libc
from torpor.errors import RegionMapFailed

__all__ = ["create_region", "map_anywhere", "map_over", "populate", "unmap"]

_MAP_FIXED = 0x10
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable, their contents untouched
_MAP_FAILED = ctypes.c_void_p(-1).value


def create_region(name: str, nbytes: int) -> int:
    """A new memfd of ``nbytes`` (zeros, nothing faulted in), sealed at that size; its descriptor (close-on-exec)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _checked(got: int | None, what: str) -> int:
    if got in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        msg = f"{what} failed: {os.strerror(err)}"
        raise RegionMapFailed(err, msg)
    return int(got)  # type: ignore[arg-type]


def map_over(fd: int, address: int, nbytes: int) -> None:
    """Map region ``fd`` (shared, read-write) over ``[address, address + nbytes)``, replacing what was mapped there."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = _checked(_libc().mmap(address, nbytes, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0), "mapping a keeper region")
    if got != address:  # MAP_FIXED maps where asked or fails
        _libc().munmap(got, nbytes)
        msg = f"a keeper region was mapped at {got:#x}, not at {address:#x}"
        raise RegionMapFailed(msg)
    _libc().madvise(address, nbytes, _MADV_HUGEPAGE)  # huge pages where shmem allows them (shmem_enabled); advice only


def map_anywhere(fd: int, nbytes: int) -> int:
    """Map region ``fd`` (shared, read-write) at an address the kernel picks; return it."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    return _checked(_libc().mmap(None, nbytes, prot, mmap.MAP_SHARED, fd, 0), "mapping a keeper region")


def unmap(address: int, nbytes: int) -> None:
    """Unmap a mapping made by :func:`map_anywhere`."""
    if _libc().munmap(address, nbytes) != 0:
        err = ctypes.get_errno()
        msg = f"unmapping a keeper region at {address:#x} failed: {os.strerror(err)}"
        raise RegionMapFailed(err, msg)


def populate(address: int, nbytes: int) -> bool:
    """Fault ``[address, address + nbytes)`` of a mapped region in, writable, without touching a byte; False: not done.

    Never falls back to writing (that would overwrite a backup): on a kernel
    without ``MADV_POPULATE_WRITE`` the pages fault in later, as they are used.
    """
    return int(_libc().madvise(address, nbytes, _MADV_POPULATE_WRITE)) == 0
