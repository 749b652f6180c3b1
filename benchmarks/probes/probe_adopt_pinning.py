"""Probe (issue 41): where an adoption's time goes, pinning a keeper's shmem pages this process never mapped.

Run on a GPU machine: ``python benchmarks/probes/probe_adopt_pinning.py [--gib 14] [--threads 16]``.
A memfd of ``--gib`` GiB is filled through one mapping, which is then unmapped (the keeper's pages exist,
this process's page tables hold none of them: what an adopter finds). Each variant maps it afresh and
times, per phase: faulting in, registering (``cudaHostRegister``), the host-to-device copy into one
device buffer, unregistering, unmapping. Variants:

- ``one``: one ``cudaHostRegister`` of the whole region (faults inside the driver), then the copy;
- ``pieces``: 256 MiB pieces registered on ``--threads`` threads, then the copy;
- ``adopt``: ``torpor.keeper.pinnedcopy`` as ``adopt()`` runs it: each piece faulted in with
  ``MADV_POPULATE_WRITE`` and registered on its thread, the copies enqueued as pieces finish;
- ``populate-one``: every piece faulted in on the threads first, then one registration of the whole;
- ``ring``: nothing of the region registered: ``--threads`` threads each own two pinned slots of
  ``--slot-mib`` (allocated in the timing), copy a piece of the region into a slot with the CPU and
  enqueue the slot's host-to-device copy on their own stream (a slot is reused once its copy's event
  is done): the staged sleep's path in reverse.

``--anon`` reads an anonymous private mapping this process filled instead (resident pages, mapped,
unregistered: what a wake meets right after a staged sleep) for ``ring`` and ``pieces``.

Prints one line per variant; the floor is the bytes over the pinned bandwidth of a torch pinned buffer.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from torpor.allocator.native.libc import libc
from torpor.keeper import shmem
from torpor.keeper.pinnedcopy import PinnedPieces, copy_into

GiB = 1 << 30
PIECE = 256 << 20


def _fill(fd: int, nbytes: int) -> None:
    address = shmem.map_anywhere(fd, nbytes)
    block = bytes(range(256)) * (4 << 10)  # 1 MiB of a pattern
    for off in range(0, nbytes, len(block)):
        ctypes.memmove(address + off, block, min(len(block), nbytes - off))
    shmem.unmap(address, nbytes)


def pinned_bandwidth(nbytes: int) -> float:
    """Host-to-device bytes per second from a torch pinned buffer (up to 4 GiB): the floor's rate."""
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


class _Whole:
    """The region as one tensor's backup, in 256 MiB segments (what copy_into reads)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.parts = [(address + off, min(PIECE, nbytes - off), off) for off in range(0, nbytes, PIECE)]

    def segments(self, name: str) -> list[tuple[int, int, int]]:
        return self.parts


def _timed(times: dict[str, float], key: str, fn: Callable[[], object]) -> None:
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    times[key] = time.perf_counter() - t


def _ring(address: int, nbytes: int, dst: torch.Tensor, threads: int, slot: int) -> None:
    """Copy ``[address, address + nbytes)`` into ``dst`` through pinned slots: CPU copy in, DMA out, per thread."""
    pieces = [(off, min(slot, nbytes - off)) for off in range(0, nbytes, slot)]
    device = dst.device

    def run(mine: list[tuple[int, int]]) -> None:
        torch.cuda.set_device(device)
        slots = [torch.empty(slot, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        events: list[torch.cuda.Event | None] = [None, None]
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            for i, (off, n) in enumerate(mine):
                k = i % 2
                done = events[k]
                if done is not None:
                    done.synchronize()
                ctypes.memmove(slots[k].data_ptr(), address + off, n)
                dst[off : off + n].copy_(slots[k][:n], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events[k] = event
        stream.synchronize()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, [pieces[i::threads] for i in range(threads)]))


def variant(
    name: str, fd: int, nbytes: int, threads: int, dst: torch.Tensor, slot: int = 32 << 20, anon: int = 0
) -> dict[str, float]:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    address = anon or shmem.map_anywhere(fd, nbytes)
    if name == "ring":
        _timed(times, "ring copy", lambda: _ring(address, nbytes, dst, threads, slot))
        times["resident"] = time.perf_counter() - t0
        if not anon:
            _timed(times, "unmap", lambda: shmem.unmap(address, nbytes))
        return times
    pieces = [(address + off, min(PIECE, nbytes - off)) for off in range(0, nbytes, PIECE)]
    registered: list[int] = []
    with ThreadPoolExecutor(threads) as pool:
        if name == "populate-one":
            _timed(times, "populate", lambda: list(pool.map(lambda p: shmem.populate(*p), pieces)))
        if name in ("one", "populate-one"):
            _timed(times, "register", lambda: _register_whole(cudart, address, nbytes))
            registered.append(address)
            _timed(times, "copy", lambda: _copy(address, nbytes, dst, True))
        elif name == "pieces":
            ok: list[bool] = []
            _timed(
                times,
                "register",
                lambda: ok.extend(pool.map(lambda p: int(cudart.cudaHostRegister(*p, 1)) == 0, pieces)),
            )
            registered += [p[0] for p, good in zip(pieces, ok, strict=True) if good]
            _timed(times, "copy", lambda: _copy(address, nbytes, dst, all(ok)))
        else:  # adopt's own: torpor.keeper.pinnedcopy, pieces faulted in and pinned on the threads, copies pipelined
            pinned = PinnedPieces(
                [(address, nbytes)],
                lambda a, n: int(cudart.cudaHostRegister(a, n, 1)) == 0,
                lambda a, _n: cudart.cudaHostUnregister(a),
                threads=threads,
                populate=shmem.populate,
            )
            _timed(times, "populate+register+copy", lambda: copy_into(_Whole(address, nbytes), [("x", dst)], pinned))
        times["resident"] = time.perf_counter() - t0
        if name == "adopt":
            _timed(times, "unregister", pinned.release)
        else:
            _timed(times, "unregister", lambda: list(pool.map(cudart.cudaHostUnregister, registered)))
    if not anon:
        _timed(times, "unmap", lambda: shmem.unmap(address, nbytes))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=14.0)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--slot-mib", type=int, default=32)
    parser.add_argument("--anon", action="store_true", help="read an anonymous mapping this process filled")
    parser.add_argument("--variants", default="one,pieces,adopt,populate-one,ring")
    args = parser.parse_args()
    nbytes = int(args.gib * GiB) // mmap.PAGESIZE * mmap.PAGESIZE
    fd = shmem.create_region("probe-adopt", nbytes)
    try:
        _fill(fd, nbytes)
        floor = nbytes / pinned_bandwidth(nbytes)
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        print(f"{nbytes / 1e9:.2f} GB, floor {floor:.3f} s, {args.threads} threads, pieces of {PIECE >> 20} MiB")
        anon = 0
        if args.anon:
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            anon = int(libc().mmap(None, nbytes, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0))
            block = bytes(range(256)) * (4 << 10)
            for off in range(0, nbytes, len(block)):
                ctypes.memmove(anon + off, block, min(len(block), nbytes - off))
        for name in args.variants.split(","):
            times = variant(name.strip(), fd, nbytes, args.threads, dst, args.slot_mib << 20, anon)
            if name.strip() in ("ring", "pieces"):
                check = torch.empty(1 << 20, dtype=torch.uint8)
                check.copy_(dst[nbytes - (1 << 20) :])
                expect = torch.frombuffer(bytearray(bytes(range(256)) * (4 << 10)), dtype=torch.uint8)
                times["exact"] = float(bool(torch.equal(check, expect)))
            line = ", ".join(f"{k} {v:.3f} s" for k, v in times.items())
            print(f"{name:16s} resident {times['resident'] / floor:.2f}x the floor: {line}", flush=True)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
