"""Tests of CudaDriver's host pages (csrc/hostpages.c) and of the view without a GPU (its driver calls are GPU-tested)."""

from __future__ import annotations

import ctypes

import pytest

from torpor.allocator import DriverError
from torpor.allocator.native.cuda_driver import (
    CudaDriver,
    fault_host_pages,
    free_host_pages,
    host_page_methods,
    populate_host_pages,
    reserve_host_pages,
    transparent_huge_pages,
)
from torpor.errors import OutOfMemory

MiB = 1 << 20


def test_host_pages_are_writable_huge_page_aligned_and_freed() -> None:
    """Reserved host pages start on a 2 MiB boundary, fault in writable, and unmap piece by piece."""
    address = reserve_host_pages(8 * MiB)
    assert address % (2 * MiB) == 0
    populate_host_pages(address, 4 * MiB)
    populate_host_pages(address + 4 * MiB, 4 * MiB)
    ctypes.memset(address, 0x5A, 8 * MiB)
    assert ctypes.string_at(address + 8 * MiB - 3, 3) == b"ZZZ"
    free_host_pages(address, 4 * MiB)
    free_host_pages(address + 4 * MiB, 4 * MiB)


def test_huge_page_mode_is_read_from_the_kernel() -> None:
    """The transparent huge page mode is one of the kernel's words, or 'unavailable'."""
    assert transparent_huge_pages() in {"always", "madvise", "never", "unavailable"}


def test_host_pages_beyond_memory_raise_out_of_memory() -> None:
    """A mapping larger than the machine can give raises an OutOfMemory driver error naming mmap."""
    with pytest.raises(OutOfMemory, match="mmap"):
        reserve_host_pages(1 << 55)


def test_freeing_pages_that_are_not_a_mapping_raises() -> None:
    """munmap of an unaligned address fails with a DriverError naming munmap and the address."""
    with pytest.raises(DriverError, match="munmap"):
        free_host_pages(4097, 4096)


def test_a_new_driver_touches_no_cuda() -> None:
    """Constructing CudaDriver makes no CUDA call and opens nothing (import and construction work without a GPU)."""
    drv = CudaDriver()
    assert drv._driver is None and drv.lib is None and not drv._ready


def test_the_view_makes_no_vmm_call() -> None:
    """CudaDriver has no reserve/create/map/... of its own: the native table makes them."""
    for call in ("reserve", "unreserve", "create", "map", "set_access", "unmap", "release"):
        assert not hasattr(CudaDriver, call) and not hasattr(CudaDriver, "_" + call), call


def test_fresh_pages_are_faulted_by_writing_when_the_host_has_room() -> None:
    """With room, fault_host_pages writes zeros (fast) and never populates."""
    address = reserve_host_pages(4 * MiB)
    ctypes.memset(address, 7, 1)
    assert fault_host_pages(address, 4 * MiB, write=True) == "written"
    assert ctypes.string_at(address, 2) == b"\0\0" and ctypes.string_at(address + 4 * MiB - 2, 2) == b"\0\0"
    free_host_pages(address, 4 * MiB)


def test_fresh_pages_are_populated_when_the_host_has_no_clear_room() -> None:
    """Without clear room, fault_host_pages populates (a clean ENOMEM), leaving what a page holds as it is."""
    address = reserve_host_pages(4 * MiB)
    ctypes.memset(address, 7, 1)
    how = fault_host_pages(address, 4 * MiB, write=False)
    assert how in {"populated", "zero-filled"}  # zero-filled: a kernel before 5.14 (no MADV_POPULATE_WRITE)
    assert ctypes.string_at(address, 1) == (b"\x07" if how == "populated" else b"\0")
    free_host_pages(address, 4 * MiB)


def test_populating_turned_off_fills_with_zeros_and_turns_back_on() -> None:
    """host_page_methods(populate=False) is a kernel before 5.14: pages are zero-filled; the old methods come back."""
    was = host_page_methods(huge_pages=False, populate=False)
    try:
        address = reserve_host_pages(2 * MiB)
        assert fault_host_pages(address, 2 * MiB, write=False) == "zero-filled"
        free_host_pages(address, 2 * MiB)
    finally:
        assert host_page_methods(*was) == (False, False)
    assert host_page_methods() == was
