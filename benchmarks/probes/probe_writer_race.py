"""Probe: one or more threads fill tensors in tags (one block per allocation) while the main thread multiplies.

The loop of issue 26 as a user wrote it: ``with alloc.use_memory_pool(tag): keep.append(torch.ones(1 << 16))``,
at most 64 kept, 32 dropped at a time, while the main thread runs ``a = (a @ a).tanh_()`` in the default pool.
Prints one line: seconds, matmuls, blocks per worker, and the first error (a CUDA error loses the context).

    python benchmarks/probes/probe_writer_race.py [--workers N] [--seconds S] [--stats] [--numel N]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from torpor import SleepController
from torpor.allocator import TaggedAllocator


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--stats", action="store_true", help="a thread calls memory_stats() and empty_cache()")
    parser.add_argument("--numel", type=int, default=1 << 16)
    args = parser.parse_args()
    alloc = TaggedAllocator()
    SleepController(alloc)
    stop = threading.Event()
    errors: list[str] = []
    blocks = [0] * args.workers

    def work(i: int) -> None:
        keep: list[torch.Tensor] = []
        tag = "weights" if i == 0 else f"weights{i}"
        try:
            while not stop.is_set():
                with alloc.use_memory_pool(tag):
                    keep.append(torch.ones(args.numel, device="cuda"))
                if len(keep) > 64:
                    del keep[:32]
                blocks[i] += 1
        except Exception as exc:
            errors.append(f"worker {i}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            stop.set()

    def stats() -> None:
        while not stop.is_set():
            torch.cuda.memory_stats()
            torch.cuda.empty_cache()
            time.sleep(0.002)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(args.workers)]
    if args.stats:
        threads.append(threading.Thread(target=stats, daemon=True))
    for t in threads:
        t.start()
    a = torch.randn(2048, 2048, device="cuda")
    steps, start = 0, time.monotonic()
    try:
        while time.monotonic() - start < args.seconds and not stop.is_set():
            a = (a @ a).tanh_()
            steps += 1
        torch.cuda.synchronize()
    except Exception as exc:
        errors.append(f"main: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    stop.set()
    for t in threads:
        t.join(10)
    print(
        f"writer race: {time.monotonic() - start:.1f} s, {steps} matmuls, blocks {blocks}, "
        f"trimmed {alloc._torch.pools().blocks.trimmed_bytes} B, first error: {errors[0] if errors else None}"
    )


if __name__ == "__main__":
    main()
