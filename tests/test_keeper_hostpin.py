"""Pinning kept regions through the CUDA driver from pool threads: the model's GPU's context, released at close."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from typing import Any

import pytest

from torpor.errors import PinningUnavailable
from torpor.keeper import hostpin
from torpor.keeper.hostpin import HostPinning


class FakeCuda:
    """libcuda's calls that HostPinning makes, recorded with the calling thread."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[tuple[str, Any, int]] = []
        self.fail = fail

    def _note(self, name: str, arg: Any) -> int:
        self.calls.append((name, arg, threading.get_ident()))
        return 2 if name == self.fail else 0

    def cuInit(self, flags: int) -> int:
        return self._note("cuInit", flags)

    def cuDeviceGet(self, out: Any, ordinal: int) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = 40 + ordinal
        return self._note("cuDeviceGet", ordinal)

    def cuDevicePrimaryCtxRetain(self, out: Any, dev: ctypes.c_int) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0xC0
        return self._note("retain", dev.value)

    def cuCtxSetCurrent(self, ctx: ctypes.c_void_p) -> int:
        return self._note("current", ctx.value)

    def cuMemHostRegister_v2(self, address: int, nbytes: int, flags: int) -> int:
        return self._note("register", (address, nbytes, flags))

    def cuMemHostUnregister(self, address: int) -> int:
        return self._note("unregister", address)

    def cuDevicePrimaryCtxRelease_v2(self, dev: ctypes.c_int) -> int:
        return self._note("release", dev.value)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(hostpin, "_opened", [fake])
    return fake


def test_each_pin_and_unpin_makes_the_devices_primary_context_current_on_its_thread(cuda: FakeCuda) -> None:
    """GPU 3's primary context is retained once, made current before every call on the pool's thread, released once."""
    pinning = HostPinning(3)
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.extend([pinning.pin(4096, 8192), pinning.unpin(4096, 8192)]))
    worker.start()
    worker.join()
    pinning.close()
    pinning.close()
    assert results == [True, 0]
    names = [(n, a) for n, a, _ in cuda.calls]
    assert names == [
        ("cuInit", 0),
        ("cuDeviceGet", 3),
        ("retain", 43),
        ("current", 0xC0),
        ("register", (4096, 8192, 1)),  # portable: any context may copy from it
        ("current", 0xC0),
        ("unregister", 4096),
        ("release", 43),
    ]
    assert {t for n, _, t in cuda.calls if n in ("current", "register", "unregister")} == {worker.ident}


def test_a_context_that_cannot_be_had_raises_naming_the_call_and_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed retain of the primary context raises PinningUnavailable with the call, the GPU and the error."""
    monkeypatch.setattr(hostpin, "_opened", [FakeCuda(fail="retain")])
    with pytest.raises(PinningUnavailable, match=r"cuDevicePrimaryCtxRetain for GPU 1 failed with CUDA error 2"):
        HostPinning(1)


def test_a_failed_register_says_false_and_no_driver_says_why(cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    """A register the driver refuses returns False (the piece is copied pageable); no libcuda raises PinningUnavailable."""
    cuda.fail = "register"
    assert HostPinning(0).pin(4096, 4096) is False

    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(hostpin, "_opened", [])
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(PinningUnavailable, match=r"libcuda\.so\.1\) cannot be opened"):
        HostPinning(0)


@pytest.mark.gpu
def test_a_real_pin_holds_no_gil_and_copies_at_the_right_bytes() -> None:
    """On a GPU: pinning 1 GiB on a thread lets Python run meanwhile; the pinned bytes copy to the device exactly."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from torpor.allocator.native.libc import libc

    nbytes = 1 << 30
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    address = int(libc().mmap(None, nbytes, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0))
    host = torch.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype=torch.uint8)
    host.copy_(torch.arange(256, dtype=torch.uint8).repeat(nbytes // 256))
    pinning = HostPinning(torch.cuda.current_device())
    done: list[bool] = []
    worker = threading.Thread(target=lambda: done.append(pinning.pin(address, nbytes)))
    ticks = 0
    t0 = time.perf_counter()
    worker.start()
    while worker.is_alive():
        ticks += 1
    worker.join()
    elapsed = time.perf_counter() - t0
    try:
        assert done == [True]
        assert ticks > 1000, f"the main thread ran {ticks} times in the {elapsed:.3f} s pin: the GIL was held"
        dst = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), host)
    finally:
        assert pinning.unpin(address, nbytes) == 0
        pinning.close()
        del host
        libc().munmap(address, nbytes)
