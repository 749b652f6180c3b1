"""Tests of CudaDriver's host-memory helpers that run without a GPU (the driver calls themselves are GPU-tested)."""

from __future__ import annotations

import ctypes

import pytest

from torpor.allocator import DriverError
from torpor.allocator.native.cuda_driver import (
    CudaDriver,
    free_host_pages,
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
    """Constructing CudaDriver makes no CUDA call (import and construction work without a GPU)."""
    drv = CudaDriver()
    assert drv._ctx == {} and drv._host_sizes == {}


def test_fresh_pages_are_faulted_by_writing_when_the_host_has_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """With room, fault_host_pages writes zeros (fast) and never populates."""
    from torpor.allocator.native import cuda_driver
    from torpor.allocator.native.headroom import Headroom

    populated: list[int] = []
    monkeypatch.setattr(cuda_driver, "populate_host_pages", lambda a, n: populated.append(n))
    address = reserve_host_pages(4 * MiB)
    cuda_driver.fault_host_pages(address, 4 * MiB, Headroom(margin=0).claim)
    assert populated == [] and ctypes.string_at(address + 4 * MiB - 2, 2) == b"\0\0"
    free_host_pages(address, 4 * MiB)


def test_fresh_pages_are_populated_when_the_host_has_no_clear_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without clear room, fault_host_pages populates (a clean ENOMEM) instead of writing (the OOM killer)."""
    from torpor.allocator.native import cuda_driver
    from torpor.allocator.native.headroom import Headroom

    populated: list[int] = []
    monkeypatch.setattr(cuda_driver, "populate_host_pages", lambda a, n: populated.append(n))
    address = reserve_host_pages(4 * MiB)
    cuda_driver.fault_host_pages(address, 4 * MiB, Headroom(margin=1 << 60).claim)
    assert populated == [4 * MiB]
    free_host_pages(address, 4 * MiB)
