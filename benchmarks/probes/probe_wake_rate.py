"""Probe (issue 38): why an 8B-shaped wake copies at 37-43 GB/s where the synthetic rows reach the floor.

Run on a GPU machine: ``python benchmarks/probes/probe_wake_rate.py``. Prints, one line each:

- raw host-to-device copy rates from torch's pinned memory at 2, 8 and 14 GiB (one copy, and in
  64 MiB pieces), and from anonymous memory (huge pages advised) registered with cudaHostRegister;
- an 8B-shaped model's weights (Qwen3-8B in vLLM's fused layout, 36 layers, 14.4 GB in 471 tensors
  made through torch's pool in tag ``weights``) beside a 56 GiB KV cache in tag ``kv_cache``, level-1
  sleep and three wakes, weights then KV cache (vLLM's order), with each tag's restore seconds from
  the event log; once with the wake's map-then-copy per span (today's code) and once with every span
  of a tag mapped before its first copy (``--map-first`` behaviour, patched in here).
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any

import torch

from torpor import SleepController, TaggedAllocator
from torpor.allocator.sleepwake import cycle
from torpor.allocator.sleepwake.plan import clip_each, copies, pieces, spans
from torpor.statemachine.core.policy import HostMemoryPolicy, Policy

GiB = 1 << 30
MiB = 1 << 20


def copy_rate(dst: torch.Tensor, src: torch.Tensor, step: int = 0, repeats: int = 3) -> float:
    """Best GB/s of copying ``src`` into ``dst`` (one copy, or pieces of ``step`` bytes)."""
    best = float("inf")
    n = src.numel()
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for off in range(0, n, step or n):
            end = off + (step or n)
            dst[off:end].copy_(src[off:end], non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9


def raw_rates() -> None:
    dev = torch.empty(14 * GiB, dtype=torch.uint8, device="cuda")
    for size in (2 * GiB, 8 * GiB, 14 * GiB):
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host.fill_(1)
        d = dev[:size]
        one, many, back = copy_rate(d, host), copy_rate(d, host, 64 * MiB), copy_rate(host, d)
        print(
            f"torch pinned {size // GiB:>2} GiB: H2D {one:.1f} GB/s, in 64 MiB pieces {many:.1f} GB/s; D2H {back:.1f} GB/s"
        )
        del host
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 14 * GiB
    cudart = torch.cuda.cudart()
    for advise in (14, 0):  # MADV_HUGEPAGE, then none
        raw = libc.mmap(None, size + 2 * MiB, 3, 0x22, -1, 0)
        addr = (raw + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)
        if advise:
            libc.madvise(addr, size, advise)
        ctypes.memset(addr, 1, size)
        err = cudart.cudaHostRegister(addr, size, 0)
        host = torch.frombuffer((ctypes.c_uint8 * size).from_address(addr), dtype=torch.uint8)
        one, back = copy_rate(dev, host), copy_rate(host, dev)
        label = "huge pages advised" if advise else "4 KiB pages"
        print(f"mmap + cudaHostRegister ({label}, err {err}) 14 GiB: H2D {one:.1f} GB/s, D2H {back:.1f} GB/s")
        del host
        cudart.cudaHostUnregister(addr)
        libc.munmap(raw, size + 2 * MiB)
    del dev
    torch.cuda.empty_cache()


def remap_map_first(self: Any, tag: str, record: Any, live: list[Any]) -> None:
    """Today's ``_remap`` with every span of the tag mapped before its first copy is enqueued."""
    if not live:
        return
    gran = self.granularity(live[0].device)
    step = max(self.piece_bytes // gran, 1) * gran if record.backed_up else max(n for _, n, _ in live)
    todo = [(s[0].start, sum(p.size for p in s), s[0].device) for s in spans(pieces(live, step), self.group_bytes)]
    held = clip_each(record.pieces, [(s, s + n) for s, n, _ in todo]) if record.backed_up else [[] for _ in todo]
    for start, size, device in todo:
        self.table.map_span(tag, start, size, device)
    for parts in held:
        for dev, address, host, n in copies(parts, record.backups):
            self.host.wait_readable(host)
            self.driver.copy_h2d(address, host, n, dev)


def shapes_8b() -> list[tuple[int, ...]]:
    hidden, inter, layers, vocab, kv, head = 4096, 12288, 36, 32000, 8, 128
    out: list[tuple[int, ...]] = [(vocab, hidden)]
    for _ in range(layers):
        out += [(hidden + 2 * kv * head, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
        out += [(hidden,), (hidden,), (head,), (head,)]
    out += [(hidden,), (vocab, hidden)]
    return out


def model_run(label: str, kv_gib: int = 56, pause: float = 0.0) -> None:
    alloc = TaggedAllocator()
    ctl = SleepController(alloc, policy=Policy(host=HostMemoryPolicy(pin="ahead")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    with alloc.use_memory_pool("weights"):
        weights = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes_8b()]
        for w in weights:
            w.normal_(generator=gen)
    with alloc.use_memory_pool("kv_cache"):
        kv = [torch.zeros(kv_gib * GiB // 36, dtype=torch.uint8, device="cuda") for _ in range(36 if kv_gib else 0)]
    nbytes = sum(w.numel() * 2 for w in weights)
    probe_host = torch.ones(1 * GiB, dtype=torch.uint8, pin_memory=True)
    probe_dev = torch.empty(1 * GiB, dtype=torch.uint8, device="cuda")
    sums = [float(w.float().sum()) for w in weights[:8]]
    alloc.wait_host_ready(600)
    for cyc in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ctl.sleep(1)
        slept = time.perf_counter() - t0
        seq = ctl.last_seq
        time.sleep(pause)
        link = copy_rate(probe_dev, probe_host)  # the link right before the wake
        t0 = time.perf_counter()
        ctl.wake(["weights"])
        woke_w = time.perf_counter() - t0
        t0 = time.perf_counter()
        ctl.wake(["kv_cache"])
        woke_kv = time.perf_counter() - t0
        restored = {
            getattr(e.data, "tag", None): round(getattr(e.data, "seconds", 0.0), 3)
            for e in ctl.events(seq)
            if e.kind.value == "tag_restored"
        }
        ok = [float(w.float().sum()) for w in weights[:8]] == sums
        print(
            f"{label} (KV {kv_gib} GiB, pause {pause} s) cycle {cyc}: {len(weights)} tensors {nbytes / 1e9:.2f} GB; "
            f"sleep {slept:.3f} s; link before the wake {link:.1f} GB/s; "
            f"wake weights {woke_w:.3f} s ({nbytes / woke_w / 1e9:.1f} GB/s), kv {woke_kv:.3f} s; "
            f"tag_restored {restored}; exact {ok}"
        )
    del weights, kv, probe_host, probe_dev
    alloc.close()
    torch.cuda.empty_cache()


def after_release(gib: int = 56) -> None:
    """The link right after torch's own allocator gives ``gib`` GiB back (cudaFree): no torpor involved."""
    host = torch.ones(512 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    quiet = copy_rate(dev, host)
    big = [torch.zeros(GiB, dtype=torch.uint8, device="cuda") for _ in range(gib)]
    torch.cuda.synchronize()
    del big
    t0 = time.perf_counter()
    torch.cuda.empty_cache()  # cudaFree of every cached segment
    freed = time.perf_counter() - t0
    samples = []
    while time.perf_counter() - t0 < 3.0:
        samples.append((round(time.perf_counter() - t0, 2), round(copy_rate(dev, host, repeats=1), 1)))
    print(f"torch cudaFree of {gib} GiB took {freed:.3f} s; H2D before {quiet:.1f} GB/s; after (s, GB/s): {samples}")


def main() -> None:
    if "--release" in sys.argv:
        after_release()
        return
    if "--quick" not in sys.argv:
        raw_rates()
        original = cycle.SleepWake._remap
        cycle.SleepWake._remap = remap_map_first  # type: ignore[method-assign]
        try:
            model_run("map-first")
        finally:
            cycle.SleepWake._remap = original  # type: ignore[method-assign]
    model_run("today", kv_gib=0)
    model_run("today", kv_gib=56)
    model_run("today", kv_gib=56, pause=2.0)


if __name__ == "__main__":
    main()
