"""GPU probe: the staged cold sleep's shape (threads x slot size) on never-used host memory, in one process.

``python benchmarks/probes/probe_stage_shape.py [GiB] [rounds] [T x SLOT_MiB,...]`` (default
``8 2 16x16,8x16,16x8,12x8``): for each round, each variant in turn gets a new
allocator, ``GiB`` in 64 tensors and one cold ``sleep(1)`` timed; every allocator
stays asleep until the end, so each variant's sleep faults host pages no earlier
variant used (on a freshly started machine: pages the guest never touched).
Interleaved rounds show the order's effect. At the end every engine wakes and is
checked bit-exact.
"""

from __future__ import annotations

import sys
import time

import torch

from torpor import HostMemoryPolicy, Policy, SleepController, TaggedAllocator
from torpor.bench.device import fill, measure_floor, same

GiB = 1 << 30
MiB = 1 << 20


def main() -> None:
    """Time one cold sleep per variant and round; print a line each, then the bit-exact check."""
    total = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    spec = sys.argv[3] if len(sys.argv) > 3 else "16x16,8x16,16x8,12x8"
    variants = [tuple(int(x) for x in v.split("x")) for v in spec.split(",")]
    torch.cuda.init()
    d2h, _ = measure_floor()
    floor = total / d2h
    engines = []
    for r in range(rounds):
        for threads, slot_mib in variants:
            alloc = TaggedAllocator()
            alloc._host.configure(stage_threads=threads, stage_slot_bytes=slot_mib * MiB)
            ctl = SleepController(alloc, policy=Policy(host=HostMemoryPolicy()))
            seg = total // 64
            ranges = [(alloc.allocate(seg, "weights"), seg) for _ in range(64)]
            refs = fill(ranges)
            torch.cuda.synchronize()
            t = time.perf_counter()
            ctl.sleep(1)
            dt = time.perf_counter() - t
            print(
                f"round {r} threads {threads:2d} slot {slot_mib:2d} MiB: {dt:.3f} s = {dt / floor:.2f}x "
                f"(floor {floor:.3f} s, staged {alloc._stager.copied / GiB:.1f} GiB)",
                flush=True,
            )
            engines.append((alloc, ctl, ranges, refs))
    exact = True
    for alloc, ctl, ranges, refs in engines:
        ctl.wake()
        exact = exact and same(ranges, refs)
        del refs
        for ptr, _ in ranges:
            alloc.free(ptr)
        alloc.close()
    print(f"bit-exact: {exact}", flush=True)


if __name__ == "__main__":
    main()
