"""Tests of CudaDriver's host pages (csrc/hostpages.c) and of the view without a GPU (its driver calls are GPU-tested)."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torpor.allocator import DriverError, TaggedAllocator
from torpor.allocator.native.cuda_driver import (
    CudaDriver,
    fault_host_pages,
    free_host_pages,
    host_page_methods,
    populate_host_pages,
    reserve_host_pages,
    transparent_huge_pages,
)
from torpor.errors import AllocatorError, OutOfMemory
from torpor.units import MiB


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


FAKE_CUDA = Path(__file__).with_name("fakecuda.c")
STAND_IN_RUN = """
import ctypes, threading
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_log.restype = ctypes.c_char_p
from torpor.allocator import CudaDriver, DriverError
from torpor.units import MiB
d = CudaDriver()
d.prepare_device(0)
host = d.host_alloc(3 * MiB + 5)
device = ctypes.create_string_buffer(b"torpor" * 1000)  # device memory is host memory here
d.copy_d2h(host, ctypes.addressof(device), 6000, 0)
d.wait(d.record(0))
assert ctypes.string_at(host, 6000) == b"torpor" * 1000
ctypes.memmove(host, b"X" * 6, 6)
d.copy_h2d(ctypes.addressof(device), host, 6, 0)
fake.fake_fail(b"cuEventSynchronize", 700)
try:
    d.wait(d.record(0))
except DriverError as exc:
    print("wait failed:", exc.call, exc.code, exc.reason)
assert device.raw[:12] == b"XXXXXXtorpor"
assert d.mem_info(0) == (100, 200)
d.synchronize(0)
t = threading.Thread(target=d.prepare_thread)
t.start(); t.join()
d.host_free(host)
print(fake.fake_log().decode(), end="")
"""


def stand_in_log(tmp_path: Path) -> list[str]:
    """The lines of STAND_IN_RUN: the library's CUDA table driven against tests/fakecuda.c as libcuda.so.1."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libcuda.so.1"), str(FAKE_CUDA)], check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", STAND_IN_RUN], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_the_cuda_table_copies_on_one_stream_and_spends_each_event(tmp_path: Path) -> None:
    """Against a stand-in libcuda: one non-blocking copy stream made in the primary context, every copy on it, events without timing destroyed by their wait, a failed wait raised with CUDA's error."""
    lines = stand_in_log(tmp_path)
    creates = [line for line in lines if line.startswith("cuStreamCreate")]
    assert len(creates) == 1 and creates[0].endswith("flags=1") and "ctx=0x1000" in creates[0], lines
    streams = {line.rsplit("stream=", 1)[1] for line in lines if "stream=" in line}
    assert len(streams) == 1, lines  # both copies and every event record on the one copy stream
    assert sum(line.startswith("cuMemcpy") and "Async" in line for line in lines) == 2
    made = [line for line in lines if line.startswith("cuEventCreate")]
    assert len(made) == 2 and all(line.endswith("flags=2") for line in made)
    assert sum(line.startswith("cuEventDestroy") for line in lines) == 2  # the failed wait's event too
    (failed,) = [line for line in lines if line.startswith("wait failed:")]
    assert (
        failed
        == "wait failed: cuEventSynchronize 700 CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered"
    )


def test_the_cuda_table_pins_portable_and_sets_up_helper_threads(tmp_path: Path) -> None:
    """Against a stand-in libcuda: pages registered portable and whole, unregistered at host_free; a helper thread gets the primary context and relaxed capture mode; synchronize and mem_info leave the context as they found it."""
    lines = stand_in_log(tmp_path)
    (register,) = [line for line in lines if line.startswith("cuMemHostRegister")]
    assert register.endswith(f"n={-(-(3 * MiB + 5) // 4096) * 4096} flags=1 aligned=1"), register
    assert sum(line.startswith("cuMemHostUnregister") for line in lines) == 1
    assert [line for line in lines if line.startswith("cuDevicePrimaryCtxRetain")] == [
        "cuDevicePrimaryCtxRetain ctx=(nil) dev=0"
    ]  # retained once for the process
    exchange = [line for line in lines if line.startswith("cuThreadExchangeStreamCaptureMode")]
    assert exchange == ["cuThreadExchangeStreamCaptureMode ctx=0x1000 mode=2"], lines
    sync = lines.index(next(line for line in lines if line.startswith("cuCtxSynchronize")))
    assert lines[sync].startswith("cuCtxSynchronize ctx=0x1000")


def test_without_cuda_a_bare_allocator_says_the_driver_is_missing() -> None:
    """TaggedAllocator() without CUDA's driver says the driver library is missing and names the simulated device."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("this machine has CUDA's driver library")
    with pytest.raises(AllocatorError) as refused:
        TaggedAllocator()
    msg = str(refused.value)
    assert msg.startswith("open the CUDA driver failed (dlopen): CUDA's driver library is missing")
    assert "TaggedAllocator(SimDriver(" in msg
