"""GPU probe: may a sleep release a discarded KV cache while the backup copies of the other tags run?

Run on a CUDA machine: ``python benchmarks/probes/probe_release_overlap.py [--kv-gib 40] [--copy-mb 412] [--rounds 3]``.
A level-1 sleep of a vLLM engine copies its weights and graphs to the host (about 412 MB) and
releases its KV cache (tens of GB, nothing copied). torpor waits for the copies before it
releases anything; this measures, with torpor's CudaDriver and the bare VMM calls of benchmarks/vmm.py, the two orders:

* ``after``: enqueue the copies, wait for them, then unmap + release the cache (torpor today);
* ``during``: enqueue the copies, unmap + release the cache, then wait for the copies;
* ``first``: unmap + release the cache, then enqueue the copies and wait for them;

then, at once, the wake: the copied bytes back to the device (timed, ``wake_s``), and after
``--settle`` seconds the same copy again (``settled_wake_s``). The driver works on freed device
memory in the background after a release and the host link runs at half speed meanwhile
(docs/benchmarks.md, the 8B section): ``first`` asks whether that work hides under the sleep's own
copies, so that neither the sleep nor a wake right after it pays it. Checks that the bytes are right. One JSON line per round and order. If
``first`` or ``during`` leaves both the sleep and the wake at the copy's floor, releasing discarded
tags before (or while) copying the others is worth building (docs/benchmarks.md, vLLM section).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy

from torpor.allocator.native.cuda_driver import _cu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: its VMM helper
from vmm import VmmDriver

GiB, MiB = 1 << 30, 1 << 20


def _check(rc: object, call: str) -> None:
    if int(rc) != 0:  # type: ignore[call-overload]
        raise RuntimeError(f"{call}: {rc}")


def _mapped(drv: VmmDriver, nbytes: int, count: int) -> tuple[int, list[tuple[int, object]]]:
    base = drv.reserve(nbytes * count, 0)
    out = []
    for i in range(count):
        h = drv.create(nbytes, 0)
        drv.map(base + i * nbytes, nbytes, h)
        drv.set_access(base + i * nbytes, nbytes, 0)
        out.append((base + i * nbytes, h))
    return base, out


def _timed_h2d(drv: VmmDriver, address: int, host: int, nbytes: int) -> float:
    t0 = time.perf_counter()
    drv.copy_h2d(address, host, nbytes, 0)
    drv.synchronize(0)
    return time.perf_counter() - t0


def _round(
    drv: VmmDriver, order: str, layer: int, layers: int, copy: int, host: int, settle: float
) -> dict[str, object]:
    cu = _cu()
    src_base, src = _mapped(drv, copy, 1)
    kv_base, kv = _mapped(drv, layer, layers)
    (rc,) = cu.cuMemsetD8(src_base, 0x5A, copy)
    _check(rc, "cuMemsetD8")
    (rc,) = cu.cuMemsetD8(kv_base, 0, layer * layers)
    _check(rc, "cuMemsetD8")
    ctypes.memset(host, 0, copy)
    drv.synchronize(0)
    t0 = time.perf_counter()
    if order == "first":
        _release(drv, kv, layer)
        released = time.perf_counter() - t0
    drv.copy_d2h(host, src_base, copy, 0)
    event = drv.record(0)  # one-shot: waiting for it destroys it
    if order == "after":
        drv.wait(event)
    if order != "first":
        _release(drv, kv, layer)
        released = time.perf_counter() - t0
    if order != "after":
        drv.wait(event)
    total = time.perf_counter() - t0
    (rc,) = cu.cuMemsetD8(src_base, 0, copy)  # about 5 ms: the wake must bring the bytes back
    _check(rc, "cuMemsetD8")
    wake = _timed_h2d(drv, src_base, host, copy)  # at once, as a wake right after the sleep
    right = _all(host, copy, 0x5A)
    time.sleep(settle)
    settled = _timed_h2d(drv, src_base, host, copy)
    ctypes.memset(host, 0, copy)
    drv.copy_d2h(host, src_base, copy, 0)
    drv.synchronize(0)
    right = right and _all(host, copy, 0x5A)
    for address, handle in src:
        drv.unmap(address, copy)
        drv.release(handle)
    drv.unreserve(src_base, copy)
    drv.unreserve(kv_base, layer * layers)
    return {
        "order": order,
        "released_at_s": round(released, 4),
        "sleep_s": round(total, 4),
        "floor_s": round(copy / 55.2e9, 4),
        "wake_s": round(wake, 4),
        "settled_wake_s": round(settled, 4),
        "bytes_right": right,
    }


def _release(drv: VmmDriver, kv: list[tuple[int, object]], layer: int) -> None:
    for address, handle in kv:
        drv.unmap(address, layer)
        drv.release(handle)


def _all(host: int, nbytes: int, value: int) -> bool:
    return bool(
        (
            numpy.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(host)).cast("B"), dtype=numpy.uint8)
            == value
        ).all()
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--copy-mb", type=int, default=412)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between the wake and the settled one")
    ap.add_argument("--orders", default="after,during,first")
    a = ap.parse_args()
    drv = VmmDriver()
    gran = drv.granularity(0)
    layer = int(a.kv_gib * GiB / a.layers) // gran * gran
    copy = (a.copy_mb * MiB + gran - 1) // gran * gran
    host = drv.host_alloc(copy)
    try:
        orders = a.orders.split(",")
        for r in range(a.rounds):
            for order in orders if r % 2 == 0 else orders[::-1]:
                got = _round(drv, order, layer, a.layers, copy, host, a.settle)
                print(json.dumps({"round": r} | got), flush=True)
    finally:
        drv.host_free(host)


if __name__ == "__main__":
    main()
