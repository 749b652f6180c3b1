"""GPU benchmark: what releasing a large discarded KV cache costs, torpor's sleep against the bare driver calls.

Run on a CUDA machine: ``python benchmarks/release_cost.py [--kv-gib 40] [--layers 28] [--rounds 3]``.
A vLLM engine's level-1 sleep spends most of its time giving back the KV cache (tens of GB in one
allocation per layer, nothing copied). This times, on the same layout, written once with zeros:

* ``raw``: ``cuMemUnmap`` + ``cuMemRelease`` per allocation, as vLLM's ``cumem`` backend does
  (through cuda-bindings, benchmarks/vmm.py);
* ``raw-rdma``: the same with ``gpuDirectRDMACapable`` set on the allocation, as ``cumem`` sets it
  where the device supports it;
* ``torpor``: a level-1 ``SleepController.sleep`` of a ``kv_cache`` tag holding the same
  allocations (the whole sleep, and the release step alone from the event log), first and later.

One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from vmm import Vmm

from torpor import SleepController
from torpor.allocator import TaggedAllocator
from torpor.allocator.native.cuda_driver import _cu
from torpor.statemachine.core.payloads import TagReleased

GiB = 1 << 30


def _zero(address: int, nbytes: int) -> None:
    cu = _cu()
    (rc,) = cu.cuMemsetD8(address, 0, nbytes)
    if int(rc) != 0:
        raise RuntimeError(f"cuMemsetD8: {rc}")
    (rc,) = cu.cuCtxSynchronize()
    if int(rc) != 0:
        raise RuntimeError(f"cuCtxSynchronize: {rc}")


def _raw(drv: Vmm, layer: int, layers: int, rdma: bool) -> dict[str, Any]:
    cu = _cu()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.allocFlags.gpuDirectRDMACapable = int(rdma)
    base = drv.reserve(layer * layers, 0)
    handles = []
    for i in range(layers):
        h = drv.create(layer, 0, prop)
        drv.map(base + i * layer, layer, h)
        drv.set_access(base + i * layer, layer, 0)
        handles.append(h)
    _zero(base, layer * layers)
    t0 = time.perf_counter()
    for i in range(layers):
        drv.unmap(base + i * layer, layer)
    unmapped = time.perf_counter() - t0
    for h in handles:
        drv.release(h)
    total = time.perf_counter() - t0
    drv.unreserve(base, layer * layers)
    return {"unmap_s": round(unmapped, 4), "release_s": round(total - unmapped, 4), "total_s": round(total, 4)}


def _torpor(layer: int, layers: int, rounds: int) -> list[dict[str, Any]]:
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    addrs = [alloc.allocate(layer, "kv_cache") for _ in range(layers)]
    out = []
    for r in range(rounds):
        for a in addrs:
            _zero(a, layer)
        t0 = time.perf_counter()
        ctl.sleep(1)
        slept = time.perf_counter() - t0
        released = [e.data for e in ctl.events() if isinstance(e.data, TagReleased) and e.data.tag == "kv_cache"][-1]
        t0 = time.perf_counter()
        ctl.wake()
        woke = time.perf_counter() - t0
        out.append(
            {
                "round": r,
                "sleep_s": round(slept, 4),
                "release_s": round(released.seconds, 4),
                "wake_s": round(woke, 4),
                "mappings": alloc._table.stats("kv_cache").mappings,
            }
        )
    for a in addrs:
        alloc.free(a)
    alloc.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    drv = Vmm()
    gran = drv.granularity(0)
    layer = int(a.kv_gib * GiB / a.layers) // gran * gran
    for r in range(a.rounds):
        for rdma in (False, True):
            row = {"what": "raw-rdma" if rdma else "raw", "round": r, "layers": a.layers, "layer_bytes": layer}
            print(json.dumps(row | _raw(drv, layer, a.layers, rdma)), flush=True)
    for row in _torpor(layer, a.layers, a.rounds):
        print(json.dumps({"what": "torpor", "layers": a.layers, "layer_bytes": layer} | row), flush=True)


if __name__ == "__main__":
    main()
