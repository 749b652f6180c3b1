"""Probe (issue 38): can the first wake after a staged cold sleep copy at the host link's floor?

Run on a GPU machine: ``python benchmarks/probes/probe_first_wake.py [--gib 8] [--variants register,ring,hybrid]``.
Right after a staged sleep the backup sits in this process's pageable pages (resident, mapped, not
registered), and torpor's wake waits for the background registration of each chunk before its copy
(docs/allocator.md, "The staged sleep"). Each variant gets fresh anonymous memory of ``--gib`` GiB,
filled here (that state), and copies it into one device buffer:

- ``register``: today's wake: ``--register-threads`` threads register ``--piece-mib`` pieces in address
  order (the CUDA driver through ctypes, no GIL held) and each piece's copy is enqueued once it is;
- ``ring``: nothing registered: ``--ring-threads`` threads copy pieces into pinned slots (two per
  thread, ``--slot-mib``, pinned before the timing as a ring kept from the sleep would be) and enqueue
  each slot's copy on their own stream;
- ``hybrid``: both at once, the registering threads taking pieces from the front and the ring's from
  the back, until they meet.

Prints one line per variant against the floor (the bytes over a torch pinned buffer's bandwidth).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from probe_adopt_pinning import pinned_bandwidth  # benchmarks/probes/ is the script's folder

from torpor.allocator.native.libc import libc
from torpor.keeper.hostpin import HostPinning

GiB, MiB = 1 << 30, 1 << 20


def _fresh(nbytes: int) -> int:
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    address = int(libc().mmap(None, nbytes, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0))
    block = bytes(range(256)) * (4 << 10)
    for off in range(0, nbytes, len(block)):
        ctypes.memmove(address + off, block, min(len(block), nbytes - off))
    return address


class Work:
    """The pieces of one copy: registering threads take from the front, ring threads from the back."""

    def __init__(self, address: int, nbytes: int, piece: int) -> None:
        self.address = address
        self.todo = deque((off, min(piece, nbytes - off)) for off in range(0, nbytes, piece))
        self.lock = threading.Lock()
        self.registered: list[int] = []
        self.by = {"register": 0, "ring": 0}

    def take(self, front: bool) -> tuple[int, int] | None:
        with self.lock:
            if not self.todo:
                return None
            return self.todo.popleft() if front else self.todo.pop()


def _registrar(work: Work, dst: torch.Tensor, pinning: HostPinning) -> None:
    torch.cuda.set_device(dst.device)
    stream = torch.cuda.Stream(dst.device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        while (piece := work.take(front=True)) is not None:
            off, n = piece
            host = work.address + off
            pinned = pinning.pin(host, n)
            src = torch.frombuffer((ctypes.c_char * n).from_address(host), dtype=torch.uint8)
            dst[off : off + n].copy_(src, non_blocking=pinned)
            with work.lock:
                work.by["register"] += n
                if pinned:
                    work.registered.append(host)
    stream.synchronize()


def _ringer(work: Work, dst: torch.Tensor, slots: list[torch.Tensor]) -> None:
    torch.cuda.set_device(dst.device)
    stream = torch.cuda.Stream(dst.device)  # type: ignore[no-untyped-call]
    events: list[torch.cuda.Event | None] = [None] * len(slots)
    i = 0
    with torch.cuda.stream(stream):
        while (piece := work.take(front=False)) is not None:
            off, n = piece
            for at in range(0, n, slots[0].numel()):  # slot-sized parts, the slots in turn
                m = min(slots[0].numel(), n - at)
                k = i % len(slots)
                i += 1
                done = events[k]
                if done is not None:
                    done.synchronize()  # the slot's last copy has left it
                ctypes.memmove(slots[k].data_ptr(), work.address + off + at, m)
                dst[off + at : off + at + m].copy_(slots[k][:m], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events[k] = event
            with work.lock:
                work.by["ring"] += n
    stream.synchronize()


def variant(name: str, args: argparse.Namespace, dst: torch.Tensor, nbytes: int) -> dict[str, float]:
    address = _fresh(nbytes)
    pinning = HostPinning(dst.device.index or 0)
    rings = args.ring_threads if name in ("ring", "hybrid") else 0
    registrars = args.register_threads if name in ("register", "hybrid") else 0
    slots = [
        [torch.empty(args.slot_mib * MiB, dtype=torch.uint8, pin_memory=True) for _ in range(2)] for _ in range(rings)
    ]
    work = Work(address, nbytes, args.piece_mib * MiB)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, rings + registrars)) as pool:
        jobs = [pool.submit(_registrar, work, dst, pinning) for _ in range(registrars)]
        jobs += [pool.submit(_ringer, work, dst, s) for s in slots]
        for job in jobs:
            job.result()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    sample = torch.empty(MiB, dtype=torch.uint8)
    exact = True
    for off in (0, nbytes // 2 - nbytes // 2 % MiB, nbytes - MiB):
        sample.copy_(dst[off : off + MiB])
        expect = torch.frombuffer((ctypes.c_char * MiB).from_address(address + off), dtype=torch.uint8)
        exact = exact and bool(torch.equal(sample, expect))
    for host in work.registered:
        pinning.unpin(host, 0)
    pinning.close()
    libc().munmap(address, nbytes)
    return {"seconds": seconds, "registered": work.by["register"], "ringed": work.by["ring"], "exact": float(exact)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--register-threads", type=int, default=8)
    parser.add_argument("--ring-threads", type=int, default=8)
    parser.add_argument("--slot-mib", type=int, default=16)
    parser.add_argument("--piece-mib", type=int, default=32, help="torpor's host chunk (32 MiB)")
    parser.add_argument("--variants", default="register,ring,hybrid")
    args = parser.parse_args()
    nbytes = int(args.gib * GiB) // MiB * MiB
    floor = nbytes / pinned_bandwidth(nbytes)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    print(
        f"{nbytes / 1e9:.2f} GB, floor {floor:.3f} s; threads: register {args.register_threads}, ring {args.ring_threads}"
    )
    for name in args.variants.split(","):
        got = variant(name.strip(), args, dst, nbytes)
        print(
            f"{name:9s} {got['seconds']:.3f} s ({got['seconds'] / floor:.2f}x the floor); registered "
            f"{got['registered'] / 1e9:.2f} GB, through the ring {got['ringed'] / 1e9:.2f} GB; exact {bool(got['exact'])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
