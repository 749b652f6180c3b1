"""GPU benchmark: a later level-1 sleep of a large discarded KV cache, and how many mappings it unmaps.

Run on a CUDA machine: ``python benchmarks/later_sleep_mappings.py [--kv-gib 40] [--cycles 5]``.
Builds what a vLLM engine holds (400 MB of ``weights``, a ``kv_cache`` of ``--kv-gib`` GiB in
28 per-layer tensors), then runs level-1 cycles through SleepController and the real allocator,
printing one JSON line per cycle: sleep and wake seconds and the tag's mappings before the sleep.
A wake maps a tag with a backup piece by piece (each piece's copy starts at once); a discarded tag
has nothing to copy, so how it is mapped again decides what the next sleep has to unmap.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from torpor import SleepController
from torpor.allocator import TaggedAllocator

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=float, default=40.0)
    ap.add_argument("--cycles", type=int, default=5)
    a = ap.parse_args()
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("weights"):
        weights = [torch.randn(1 << 20, device="cuda") for _ in range(100)]  # 100 x 4 MiB
    layer = int(a.kv_gib * GiB / 28)
    with alloc.use_memory_pool("kv_cache"):
        kv = [torch.zeros(layer, dtype=torch.uint8, device="cuda") for _ in range(28)]
    ref = torch.stack([w.sum() for w in weights]).cpu()
    for cycle in range(a.cycles):
        mappings = alloc._table.stats("kv_cache").mappings
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ctl.sleep(1)
        slept = time.perf_counter() - t0
        t0 = time.perf_counter()
        ctl.wake()
        woke = time.perf_counter() - t0
        exact = bool(torch.equal(torch.stack([w.sum() for w in weights]).cpu(), ref))
        print(
            json.dumps(
                {
                    "cycle": cycle,
                    "kv_mappings": mappings,
                    "sleep_s": round(slept, 4),
                    "wake_s": round(woke, 4),
                    "weights_exact": exact,
                }
            ),
            flush=True,
        )
    del kv


if __name__ == "__main__":
    main()
