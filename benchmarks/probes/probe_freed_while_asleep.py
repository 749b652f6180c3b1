"""Probe (issue 51 item 8): tensors deleted while asleep, 10 sleep/wake cycles: device memory growth before and after empty_cache.

Run on a GPU machine: ``python benchmarks/probes/probe_freed_while_asleep.py mixed|small|big``. Each cycle allocates
tensors of the variant's sizes under three tags, sleeps at level 1, deletes them while asleep and wakes; it prints the
growth over the first wake's usage before and after ``torch.cuda.empty_cache()`` and each tag's table stats. The
promise (docs/allocator.md): after ``empty_cache()`` the growth over 10 cycles is at most one granule per tag touched.
Run on an H100 on 2026-12-07 after the fix: +0.0 MiB before and after empty_cache over ten cycles (mixed).
"""
import sys, torch
from torpor import SleepController
from torpor.allocator import TaggedAllocator
MiB = 1 << 20
variant = sys.argv[1]

def used(empty: bool) -> int:
    torch.cuda.synchronize()
    if empty:
        torch.cuda.empty_cache()
    f, t = torch.cuda.mem_get_info()
    return t - f

alloc = TaggedAllocator()
ctl = SleepController(alloc)
with alloc.use_memory_pool("weights"):
    w = [torch.randn(n, device="cuda") for n in (64 * MiB // 4, 3 * MiB // 4, 1000, 5 * MiB // 4)]
with alloc.use_memory_pool("kv_cache"):
    kv = torch.zeros(128 * MiB // 4, device="cuda")
sizes = {"mixed": (1000, 300_000, 3 * MiB // 4, 30 * MiB // 4, 100 * MiB // 4), "small": (1000, 100_000, 200_000), "big": (256 * MiB // 4,)}[variant]
ctl.sleep(1); ctl.wake()
base = used(True)
tags = ("weights", "kv_cache", "scratch")
for i in range(10):
    made = []
    for tag in tags:
        with alloc.use_memory_pool(tag):
            made += [torch.full((n,), float(i), device="cuda") for n in sizes]
    ctl.sleep(1)
    del made  # deleted while asleep
    ctl.wake()
    b = used(False)
    a = used(True)
    st = {t: tuple(x // MiB if k in (1, 2) else x for k, x in enumerate(alloc._table.stats(t))) for t in tags}
    print(f"{variant} cycle {i}: +{(b - base) / MiB:.0f} MiB before empty_cache, +{(a - base) / MiB:.0f} after; "
          f"stats(slabs,spareMiB,mappedMiB,maps) {st}; pools {alloc._torch.current.blocks.counts()}", flush=True)
print(f"{variant} RESULT before-empty +{(b - base) / MiB:.1f} MiB, after-empty +{(a - base) / MiB:.1f} MiB", flush=True)
alloc.close()
