"""GPU probe: may a sleep release a discarded KV cache while the backup copies of the other tags run?

Run on a CUDA machine: ``python benchmarks/probes/probe_release_overlap.py [--kv-gib 40] [--copy-mb 412] [--rounds 3]``.
A level-1 sleep of a vLLM engine copies its weights and graphs to the host (about 412 MB) and
releases its KV cache (tens of GB, nothing copied). torpor waits for the copies before it
releases anything; this measures, with torpor's CudaDriver and the bare VMM calls of benchmarks/vmm.py, the two orders:

* ``after``: enqueue the copies, wait for them, then unmap + release the cache (torpor today);
* ``during``: enqueue the copies, unmap + release the cache, then wait for the copies.

and checks that the copied bytes are right in both. One JSON line per round and order. If
``during`` is faster by about the copy time and the bytes are right, releasing discarded tags
first in a sleep is worth building (docs/benchmarks.md, vLLM section). Written after the device
time of 2026-12-01 was spent: not yet run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

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


def _round(drv: VmmDriver, order: str, layer: int, layers: int, copy: int, host: int) -> dict[str, object]:
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
    drv.copy_d2h(host, src_base, copy, 0)
    event = drv.record(0)
    if order == "after":
        drv.wait(event)
    for address, handle in kv:
        drv.unmap(address, layer)
        drv.release(handle)
    released = time.perf_counter() - t0
    drv.wait(event)
    total = time.perf_counter() - t0
    right = ctypes.string_at(host, copy) == b"\x5a" * copy
    for address, handle in src:
        drv.unmap(address, copy)
        drv.release(handle)
    drv.unreserve(src_base, copy)
    drv.unreserve(kv_base, layer * layers)
    return {"order": order, "released_at_s": round(released, 4), "total_s": round(total, 4), "bytes_right": right}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--copy-mb", type=int, default=412)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    drv = VmmDriver()
    gran = drv.granularity(0)
    layer = int(a.kv_gib * GiB / a.layers) // gran * gran
    copy = (a.copy_mb * MiB + gran - 1) // gran * gran
    host = drv.host_alloc(copy)
    try:
        for r in range(a.rounds):
            for order in ("after", "during") if r % 2 == 0 else ("during", "after"):
                print(json.dumps({"round": r} | _round(drv, order, layer, a.layers, copy, host)), flush=True)
    finally:
        drv.host_free(host)


if __name__ == "__main__":
    main()
