"""GPU probe: when torch frees a cached segment of a torpor pool (OOM retry), is a kernel still queued on it?

Run on a CUDA machine: ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64 python benchmarks/probes/probe_free_under_kernel.py``.
Prints how long the spin kernel takes alone, the device's free memory at each step, the
tag's allocations before and after the allocation that makes torch free the segment, and how
long that allocation took (a free that waits for the stream takes about the spin's time).
"""

from __future__ import annotations

import time

import torch

from torpor.allocator import TaggedAllocator

MiB = 1 << 20
SPIN = 2_000_000_000


def main() -> None:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(SPIN)
    torch.cuda.synchronize()
    print(f"spin alone: {time.perf_counter() - t0:.3f} s")
    alloc = TaggedAllocator()
    free = torch.cuda.mem_get_info()[0]
    filler = torch.empty(free - 1536 * MiB, dtype=torch.uint8, device="cuda")
    print(f"free after the filler: {torch.cuda.mem_get_info()[0] >> 20} MiB")
    with alloc.use_memory_pool("runtime"):
        x = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        print(f"free after x: {torch.cuda.mem_get_info()[0] >> 20} MiB; runtime {alloc.usage()['runtime']}")
        torch.cuda._sleep(SPIN)
        x.fill_(7)
        seen = torch.stack([x.min(), x.max()])
        del x
        t0 = time.perf_counter()
        y = torch.full((768 * MiB,), 3, dtype=torch.uint8, device="cuda")
        took = time.perf_counter() - t0
        print(f"y mapped after {took:.3f} s; runtime {alloc.usage()['runtime']}; stream {torch.cuda.current_stream()}")
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"synchronize after: {time.perf_counter() - t0:.3f} s; read {seen.tolist()}; errors {alloc.pending_errors()}")
    print(f"y holds {int(y.min().item())}..{int(y.max().item())}")
    del filler


if __name__ == "__main__":
    main()
