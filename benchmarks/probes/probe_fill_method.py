"""Probe: how fast can threads fill never-used host memory with a backup's bytes? No GPU needed for the fill.

Run first thing on a fresh machine: ``python benchmarks/probes/probe_fill_method.py [GiB] [threads] [memfd]``.
A staged sleep (torpor.allocator.host.staging) copies each 16 MiB slot of its pinned
ring into the backup's pageable pages: every page is faulted (the kernel zeroes
it) and then written. This compares two ways of filling ``GiB`` of memory the
process never touched, 16 MiB at a time from per-thread source buffers:

- ``anon``: memcpy into anonymous memory with huge pages advised (what the
  staged sleep does now), 16 MiB a call; ``anon 2M`` and ``anon 256K``: the
  same in smaller calls (glibc copies large calls with non-temporal stores,
  smaller ones through the cache, where the kernel has just zeroed the page);
- ``memfd`` (when asked for): ``pwrite`` into a memfd, then ``mmap`` it (a
  full-page write into shmem skips the zeroing; 10x slower on the H200 guest).

Each is run on never-used memory first, then again after both were freed (memory
the guest has touched). With a GPU it then times ``cudaHostRegister`` of each
filled range (what the background registration after a staged sleep does) and
checks a few bytes. Prints seconds, GB/s and the kernel's CPU time per step.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import probe_first_touch  # benchmarks/ is the script's folder

from torpor.allocator.native.cuda_driver import free_host_pages, reserve_host_pages, transparent_huge_pages

MiB = 1 << 20
GiB = 1 << 30
PIECE = 16 * MiB

_libc = ctypes.CDLL(None, use_errno=True)
_libc.memfd_create.restype = ctypes.c_int
_libc.memfd_create.argtypes = [ctypes.c_char_p, ctypes.c_uint]
_libc.pwrite.restype = ctypes.c_ssize_t
_libc.pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unavailable"


def meminfo() -> str:
    """MemTotal, MemFree, Shmem, AnonHugePages from /proc/meminfo, in GiB."""
    return probe_first_touch.meminfo(("MemTotal", "MemFree", "Shmem", "AnonHugePages"))


def sources(threads: int) -> list[int]:
    """One touched 16 MiB source buffer per thread (the pinned slot a staging thread copies from)."""
    out = []
    for i in range(threads):
        base = reserve_host_pages(PIECE)
        _libc.memset(base, 0x41 + i % 16, PIECE)
        out.append(base)
    return out


def fill_anon(total: int, src: list[int], step: int = PIECE) -> tuple[int, int]:
    """memcpy ``total`` bytes into fresh anonymous memory (huge pages advised), ``step`` bytes a call; (address, -1)."""
    base = reserve_host_pages(total)
    offsets = list(range(0, total, PIECE))

    def work(i: int) -> None:
        for o in offsets[i :: len(src)]:
            n = min(PIECE, total - o)
            for d in range(0, n, step):
                ctypes.memmove(base + o + d, src[i] + d, min(step, n - d))

    with ThreadPoolExecutor(len(src)) as pool:
        list(pool.map(work, range(len(src))))
    return base, -1


def fill_memfd(total: int, src: list[int]) -> tuple[int, int]:
    """pwrite ``total`` bytes into a fresh memfd, then map it shared; (address, fd)."""
    fd = _libc.memfd_create(b"torpor-probe", 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "memfd_create")
    os.ftruncate(fd, total)
    offsets = list(range(0, total, PIECE))

    def work(i: int) -> None:
        for o in offsets[i :: len(src)]:
            n = min(PIECE, total - o)
            done = 0
            while done < n:
                got = _libc.pwrite(fd, src[i] + done, n - done, o + done)
                if got <= 0:
                    raise OSError(ctypes.get_errno(), "pwrite")
                done += got

    with ThreadPoolExecutor(len(src)) as pool:
        list(pool.map(work, range(len(src))))
    address = _libc.mmap(None, total, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(address), fd


def release(address: int, fd: int, total: int) -> None:
    """Give a filled range back."""
    if fd < 0:
        free_host_pages(address, total)
    else:
        _libc.munmap(address, total)
        os.close(fd)


def register(address: int, total: int) -> str:
    """cudaHostRegister and unregister the range (no GPU: say so)."""
    try:
        import torch
    except ImportError:
        return "no torch"
    if not torch.cuda.is_available():
        return "no GPU"
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    rc = cudart.cudaHostRegister(address, total, 0)
    dt = time.perf_counter() - t0
    if int(rc) != 0:
        return f"register failed ({rc})"
    probe = torch.empty(4096, dtype=torch.uint8, device="cuda")
    host = (ctypes.c_uint8 * 4096).from_address(address + total - 4096)
    probe.copy_(torch.frombuffer(host, dtype=torch.uint8), non_blocking=False)
    same = bool(probe.cpu().eq(torch.frombuffer(host, dtype=torch.uint8)).all())
    cudart.cudaHostUnregister(address)
    return f"register {dt:.3f}s ({total / dt / 1e9:.1f} GB/s), bytes read back {'same' if same else 'DIFFERENT'}"


def main() -> None:
    """Each method on never-used memory, then each again on memory touched before."""
    total = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    print(
        f"THP {transparent_huge_pages()}, shmem THP {_read('/sys/kernel/mm/transparent_hugepage/shmem_enabled')}; "
        f"{os.cpu_count()} CPUs; {total / GiB:g} GiB, {threads} threads; {meminfo()}",
        flush=True,
    )
    src = sources(threads)
    methods: dict[str, Callable[[int, list[int]], tuple[int, int]]] = {
        "anon": fill_anon,
        "anon 2M": lambda t, s: fill_anon(t, s, 2 * MiB),
        "anon 256K": lambda t, s: fill_anon(t, s, MiB // 4),
    }
    if "memfd" in sys.argv[3:]:
        methods["memfd"] = fill_memfd
    for round_ in ("never-used", "touched"):
        held = []
        for name, fill in methods.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
            t0 = time.perf_counter()
            address, fd = fill(total, src)
            dt = time.perf_counter() - t0
            sys_s = resource.getrusage(resource.RUSAGE_SELF).ru_stime - before
            reg = register(address, total)
            print(
                f"{round_:10s} {name:9s}: fill {dt:.3f}s ({total / dt / 1e9:.1f} GB/s), kernel {sys_s:.2f} CPU-s; "
                f"{reg}; {meminfo()}",
                flush=True,
            )
            held.append((address, fd))
        for address, fd in held:
            release(address, fd, total)


if __name__ == "__main__":
    main()
