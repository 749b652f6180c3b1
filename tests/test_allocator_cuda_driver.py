"""Tests of CudaDriver's host-memory helpers that run without a GPU (the driver calls themselves are GPU-tested)."""

from __future__ import annotations

import ctypes

import pytest

from torpor.allocator import DriverError
from torpor.allocator.cuda_driver import CudaDriver, _free_pages, _host_pages
from torpor.errors import OutOfMemory

MiB = 1 << 20


def test_host_pages_are_writable_page_aligned_and_freed() -> None:
    """Host pages for pinning come back page-aligned and writable, and are unmapped without error."""
    address = _host_pages(4 * MiB)
    assert address % 4096 == 0
    ctypes.memset(address, 0x5A, 4 * MiB)
    assert ctypes.string_at(address + 4 * MiB - 3, 3) == b"ZZZ"
    _free_pages(address, 4 * MiB)


def test_host_pages_beyond_memory_raise_out_of_memory() -> None:
    """A mapping larger than the machine can give raises an OutOfMemory driver error naming mmap."""
    with pytest.raises(OutOfMemory, match="mmap"):
        _host_pages(1 << 55)


def test_freeing_pages_that_are_not_a_mapping_raises() -> None:
    """munmap of an unaligned address fails with a DriverError naming munmap and the address."""
    with pytest.raises(DriverError, match="munmap"):
        _free_pages(4097, 4096)


def test_a_new_driver_touches_no_cuda() -> None:
    """Constructing CudaDriver makes no CUDA call (import and construction work without a GPU)."""
    drv = CudaDriver()
    assert drv._ctx == {} and drv._host_sizes == {}
