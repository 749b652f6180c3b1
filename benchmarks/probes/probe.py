"""Feasibility probe on a GPU machine: pinning speed, VMM call costs, a ctypes pluggable MemPool with a graph."""

from __future__ import annotations

import ctypes
import inspect
import os
import sys
import threading
import time

import torch
from cuda.bindings import driver as cu

GiB = 1 << 30
MiB = 1 << 20


def ck(r):  # type: ignore[no-untyped-def]
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{r[0]}")
    return r[1] if len(r) == 2 else (r[1:] if len(r) > 2 else None)


def main() -> None:
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
    import cuda.bindings

    print("cuda-bindings", cuda.bindings.__version__)
    print(inspect.signature(torch.cuda.MemPool.__init__))
    print(inspect.getsource(torch.cuda.memory.use_mem_pool))
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    ck(cu.cuInit(0))
    ctx = ck(cu.cuCtxGetCurrent())
    print("ctx current", int(ctx))
    # pinning speed
    for nthreads, chunk in ((1, GiB), (4, 256 * MiB), (8, 256 * MiB), (16, 128 * MiB)):
        total = 4 * GiB
        ptrs: list[int] = []
        lock = threading.Lock()

        def worker(n: int, chunk: int = chunk, lock: threading.Lock = lock, ptrs: list[int] = ptrs) -> None:
            ck(cu.cuCtxSetCurrent(ctx))
            for _ in range(n):
                p = ck(cu.cuMemHostAlloc(chunk, cu.CU_MEMHOSTALLOC_PORTABLE))
                with lock:
                    ptrs.append(p)

        count = total // chunk
        t0 = time.perf_counter()
        ts = [threading.Thread(target=worker, args=(count // nthreads,)) for _ in range(nthreads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        dt = time.perf_counter() - t0
        print(f"pin 4 GiB threads={nthreads} chunk={chunk >> 20} MiB: {dt:.3f} s ({total / dt / 1e9:.2f} GB/s)")
        for p in ptrs:
            ck(cu.cuMemFreeHost(p))
    # VMM call costs and copy bandwidth
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = ck(
        cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    )
    print("granularity", gran)
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = 0
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    n = 2048
    size = 2 * MiB
    va = int(ck(cu.cuMemAddressReserve(n * size, gran, 0, 0)))
    t = {}
    t0 = time.perf_counter()
    hs = [ck(cu.cuMemCreate(size, prop, 0)) for _ in range(n)]
    t["create"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, h in enumerate(hs):
        ck(cu.cuMemMap(va + i * size, size, 0, h, 0))
    t["map"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        ck(cu.cuMemSetAccess(va + i * size, size, [desc], 1))
    t["set_access"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ck(cu.cuMemSetAccess(va, n * size, [desc], 1))
    t["set_access_once"] = time.perf_counter() - t0
    host = ck(cu.cuMemHostAlloc(n * size, cu.CU_MEMHOSTALLOC_PORTABLE))
    stream = ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    ck(cu.cuMemcpyDtoHAsync(host, va, n * size, stream))
    ck(cu.cuStreamSynchronize(stream))
    t0 = time.perf_counter()
    ck(cu.cuMemcpyDtoHAsync(host, va, n * size, stream))
    ck(cu.cuStreamSynchronize(stream))
    t["d2h_one_4GiB"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ck(cu.cuMemcpyHtoDAsync(va, host, n * size, stream))
    ck(cu.cuStreamSynchronize(stream))
    t["h2d_one_4GiB"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        ck(cu.cuMemcpyDtoHAsync(host + i * size, va + i * size, size, stream))
    t["d2h_enqueue_2048"] = time.perf_counter() - t0
    ck(cu.cuStreamSynchronize(stream))
    t["d2h_2048"] = time.perf_counter() - t0
    # unmap while copies in flight: does unmap of another range block?
    t0 = time.perf_counter()
    for i in range(n):
        ck(cu.cuMemUnmap(va + i * size, size))
    t["unmap"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for h in hs:
        ck(cu.cuMemRelease(h))
    t["release"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    big = ck(cu.cuMemCreate(n * size, prop, 0))
    t["create_4GiB_one"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ck(cu.cuMemMap(va, n * size, 0, big, 0))
    ck(cu.cuMemSetAccess(va, n * size, [desc], 1))
    t["map_access_4GiB_one"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ck(cu.cuMemUnmap(va, n * size))
    ck(cu.cuMemRelease(big))
    t["unmap_release_4GiB_one"] = time.perf_counter() - t0
    for k, v in t.items():
        print(f"{k}: {v * 1e3:.2f} ms ({v / n * 1e6:.2f} us per 2 MiB)")
    ck(cu.cuMemAddressFree(va, n * size))
    ck(cu.cuMemFreeHost(host))
    # pluggable allocator through ctypes callbacks
    ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
    live: dict[int, tuple[int, object]] = {}

    def alloc(size: int, device: int, stream: int) -> int:
        sz = (size + gran - 1) // gran * gran
        p = int(ck(cu.cuMemAddressReserve(sz, gran, 0, 0)))
        h = ck(cu.cuMemCreate(sz, prop, 0))
        ck(cu.cuMemMap(p, sz, 0, h, 0))
        ck(cu.cuMemSetAccess(p, sz, [desc], 1))
        live[p] = (sz, h)
        print("alloc", size, hex(p), "dev", device)
        return p

    def free(ptr: int, size: int, device: int, stream: int) -> None:
        print("free", hex(ptr), size)

    a_cb, f_cb = ALLOC(alloc), FREE(free)
    allocator = torch._C._cuda_customAllocator(
        ctypes.cast(a_cb, ctypes.c_void_p).value, ctypes.cast(f_cb, ctypes.c_void_p).value
    )
    pool = torch.cuda.MemPool(allocator)
    print("pool id", pool.id, "use_count", pool.use_count())
    x = torch.randn(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = x * 2  # warm
    torch.cuda.synchronize()
    with torch.cuda.graph(g, pool=pool.id, stream=s):
        c = torch.empty(1024, device="cuda")
        y = x * 2 + c
    print("use_count after capture", pool.use_count())
    c.copy_(torch.arange(1024, dtype=torch.float32, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    ref = y.clone()
    # release + remap all live
    saved = {}
    for p, (sz, h) in live.items():
        hb = bytearray(sz)
        buf = (ctypes.c_char * sz).from_buffer(hb)
        ck(cu.cuMemcpyDtoH(ctypes.addressof(buf), p, sz))
        saved[p] = hb
        ck(cu.cuMemUnmap(p, sz))
        ck(cu.cuMemRelease(h))
    for p, (sz, _) in list(live.items()):
        h = ck(cu.cuMemCreate(sz, prop, 0))
        ck(cu.cuMemMap(p, sz, 0, h, 0))
        ck(cu.cuMemSetAccess(p, sz, [desc], 1))
        buf = (ctypes.c_char * sz).from_buffer(saved[p])
        ck(cu.cuMemcpyHtoD(p, ctypes.addressof(buf), sz))
        live[p] = (sz, h)
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    print("bit-exact after remap:", torch.equal(ref, y))
    del g, y, c
    import gc

    gc.collect()
    print("use_count after graph del", pool.use_count())
    del pool
    gc.collect()
    torch.cuda.synchronize()
    print("after pool del")
    print("expandable", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
