"""Cost of torch's allocation calls on torpor's tags: new-segment malloc, free, and loading 2,000 mixed tensors.

Run once per implementation (the script uses only the public API and
``TorchPools``, present in both): ``PYTHONPATH=<tree> python benchmarks/native_alloc.py --label native``
prints one JSON line. Measures, on the current CUDA device:

- ``malloc_us``: median wall time of a ``torch.empty`` that makes a new segment
  in a tag's pool (20 MiB each, so torch calls the allocator's malloc every time);
- ``free_us``: time to drop the tag's pool (torch frees every segment through the
  allocator's free) divided by the segments;
- ``load_s`` / ``default_load_s``: 2,000 tensors of mixed sizes (4 KiB .. 64 MiB,
  fixed seed) allocated and filled in a tag, and the same with torch's default
  allocator (its cache emptied first), and their ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch

from torpor.allocator import TaggedAllocator

MiB = 1 << 20


def _sizes(n: int) -> list[int]:
    rng = random.Random(0)
    kinds = [4096, 65536, 512 * 1024, 2 * MiB, 6 * MiB, 24 * MiB, 64 * MiB]
    weights = [30, 25, 15, 12, 10, 6, 2]
    return [rng.choices(kinds, weights)[0] + rng.randrange(0, 4096, 512) for _ in range(n)]


def _load(sizes: list[int]) -> tuple[float, list[torch.Tensor]]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = []
    for i, n in enumerate(sizes):
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        t.fill_(i % 251)
        out.append(t)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    """Measure and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--label", default="native")
    parser.add_argument("--segments", type=int, default=200)
    parser.add_argument("--tensors", type=int, default=2000)
    args = parser.parse_args()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    alloc = TaggedAllocator()
    with alloc.use_memory_pool("warm"):  # the first pool and the driver's first calls are not measured
        warm = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
    del warm
    times, kept = [], []
    with alloc.use_memory_pool("seg"):
        for _ in range(args.segments):
            torch.cuda.synchronize()
            start = time.perf_counter()
            kept.append(torch.empty(20 * MiB, dtype=torch.uint8, device="cuda"))
            times.append(time.perf_counter() - start)
    del kept
    pools = alloc._torch_pools()
    pool = pools._pools.pop("seg")  # the tag's MemPool (a list of per-block pools on the native path)
    gc.collect()
    torch.cuda.synchronize()
    start = time.perf_counter()
    del pool  # the last reference: torch frees every segment of the pool through the allocator's free
    torch.cuda.synchronize()
    free_s = time.perf_counter() - start
    left = alloc.usage().get("seg")
    sizes = _sizes(args.tensors)
    with alloc.use_memory_pool("load"):
        load_s, tensors = _load(sizes)
    del tensors
    torch.cuda.empty_cache()
    default_s, tensors = _load(sizes)
    del tensors
    result = {
        "label": args.label,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "malloc_us": round(statistics.median(times) * 1e6, 1),
        "malloc_p90_us": round(sorted(times)[int(len(times) * 0.9)] * 1e6, 1),
        "free_us": round(free_s / args.segments * 1e6, 1),
        "segments_left_after_free": left.allocations if left else 0,
        "load_s": round(load_s, 4),
        "default_load_s": round(default_s, 4),
        "load_ratio": round(load_s / default_s, 3),
        "load_bytes": sum(sizes),
    }
    print(json.dumps(result))
    alloc.close()


if __name__ == "__main__":
    main()
