"""Probe (issue 41): where an adoption's time goes, pinning a keeper's shmem pages this process never mapped.

Run on a GPU machine: ``python benchmarks/probes/probe_adopt_pinning.py [--gib 14] [--threads 16]``.
A memfd of ``--gib`` GiB is filled through one mapping, which is then unmapped (the keeper's pages exist,
this process's page tables hold none of them: what an adopter finds). Each variant maps it afresh and
times, per phase: faulting in, registering (``cudaHostRegister``), the host-to-device copy into one
device buffer, unregistering, unmapping. Variants:

- ``one``: one ``cudaHostRegister`` of the whole region (faults inside the driver), then the copy;
- ``pieces``: 256 MiB pieces registered on ``--threads`` threads, then the copy;
- ``populate+pieces``: each piece faulted in with ``MADV_POPULATE_WRITE`` and registered on its thread
  (what ``torpor.keeper.adopt`` does now), the copies enqueued as pieces finish;
- ``populate, one``: every piece faulted in on the threads first, then one registration of the whole.

Prints one line per variant; the floor is the bytes over the pinned bandwidth of a torch pinned buffer.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from torpor.keeper import shmem

GiB = 1 << 30
PIECE = 256 << 20


def _fill(fd: int, nbytes: int) -> None:
    address = shmem.map_anywhere(fd, nbytes)
    block = bytes(range(256)) * (4 << 10)  # 1 MiB of a pattern
    for off in range(0, nbytes, len(block)):
        ctypes.memmove(address + off, block, min(len(block), nbytes - off))
    shmem.unmap(address, nbytes)


def _floor(nbytes: int) -> float:
    src = torch.empty(min(nbytes, 4 * GiB), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() / (time.perf_counter() - t0)


def _register_whole(cudart: object, address: int, nbytes: int) -> None:
    err = int(cudart.cudaHostRegister(address, nbytes, 1))  # type: ignore[attr-defined]
    if err != 0:
        msg = f"cudaHostRegister of {nbytes} bytes failed: error {err}"
        raise RuntimeError(msg)


def _copy(address: int, nbytes: int, dst: torch.Tensor, pinned: bool) -> None:
    for off in range(0, nbytes, PIECE):
        n = min(PIECE, nbytes - off)
        src = torch.frombuffer((ctypes.c_char * n).from_address(address + off), dtype=torch.uint8)
        dst[off : off + n].copy_(src, non_blocking=pinned)


def variant(name: str, fd: int, nbytes: int, threads: int, dst: torch.Tensor) -> dict[str, float]:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    pieces = [(off, min(PIECE, nbytes - off)) for off in range(0, nbytes, PIECE)]
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    address = shmem.map_anywhere(fd, nbytes)
    registered: list[int] = []
    with ThreadPoolExecutor(threads) as pool:
        if name == "one":
            t = time.perf_counter()
            _register_whole(cudart, address, nbytes)
            registered.append(address)
            times["register"] = time.perf_counter() - t
            t = time.perf_counter()
            _copy(address, nbytes, dst, True)
            torch.cuda.synchronize()
            times["copy"] = time.perf_counter() - t
        elif name == "pieces":
            t = time.perf_counter()
            ok = list(pool.map(lambda p: int(cudart.cudaHostRegister(address + p[0], p[1], 1)) == 0, pieces))
            registered += [address + p[0] for p, good in zip(pieces, ok, strict=True) if good]
            times["register"] = time.perf_counter() - t
            t = time.perf_counter()
            _copy(address, nbytes, dst, all(ok))
            torch.cuda.synchronize()
            times["copy"] = time.perf_counter() - t
        elif name == "populate+pieces":

            def pin(p: tuple[int, int]) -> bool:
                shmem.populate(address + p[0], p[1])
                return int(cudart.cudaHostRegister(address + p[0], p[1], 1)) == 0

            t = time.perf_counter()
            futures = [pool.submit(pin, p) for p in pieces]
            for (off, n), f in zip(pieces, futures, strict=True):
                good = f.result()
                if good:
                    registered.append(address + off)
                src = torch.frombuffer((ctypes.c_char * n).from_address(address + off), dtype=torch.uint8)
                dst[off : off + n].copy_(src, non_blocking=good)
            torch.cuda.synchronize()
            times["populate+register+copy"] = time.perf_counter() - t
        elif name == "populate, one":
            t = time.perf_counter()
            list(pool.map(lambda p: shmem.populate(address + p[0], p[1]), pieces))
            times["populate"] = time.perf_counter() - t
            t = time.perf_counter()
            _register_whole(cudart, address, nbytes)
            registered.append(address)
            times["register"] = time.perf_counter() - t
            t = time.perf_counter()
            _copy(address, nbytes, dst, True)
            torch.cuda.synchronize()
            times["copy"] = time.perf_counter() - t
        times["resident"] = time.perf_counter() - t0
        t = time.perf_counter()
        list(pool.map(cudart.cudaHostUnregister, registered))
        times["unregister"] = time.perf_counter() - t
    t = time.perf_counter()
    shmem.unmap(address, nbytes)
    times["unmap"] = time.perf_counter() - t
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=14.0)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    nbytes = int(args.gib * GiB) // mmap.PAGESIZE * mmap.PAGESIZE
    fd = shmem.create_region("probe-adopt", nbytes)
    try:
        _fill(fd, nbytes)
        floor = nbytes / _floor(nbytes)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        print(f"{nbytes / 1e9:.2f} GB, floor {floor:.3f} s, {args.threads} threads, pieces of {PIECE >> 20} MiB")
        for name in ("one", "pieces", "populate+pieces", "populate, one"):
            times = variant(name, fd, nbytes, args.threads, dst)
            line = ", ".join(f"{k} {v:.3f} s" for k, v in times.items())
            print(f"{name:16s} resident {times['resident'] / floor:.2f}x the floor: {line}", flush=True)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
