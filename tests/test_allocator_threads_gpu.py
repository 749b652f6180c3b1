"""GPU test of the native allocation path under threads: tags allocated and freed from several threads while the engine sleeps and wakes.

The hang this guards against (issue 13): torch calls a pluggable allocator's
malloc and free under its own mutex; with Python callbacks any thread holding
the GIL while it waits for that mutex (a tensor's free, a new MemPool,
memory_stats, empty_cache) deadlocked with them. Run in its own process
(scripts/gpu-suite); a hang dumps every thread's stack and fails.
"""

from __future__ import annotations

import faulthandler
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from torpor import SleepController, State, TorporError
from torpor.allocator import TaggedAllocator

pytestmark = pytest.mark.gpu
MiB = 1 << 20
SIZES = [512, 4096, 65536, 1 * MiB, 3 * MiB, 9 * MiB, 24 * MiB]


@dataclass
class Worker:
    """One allocating thread: its tags, a tensor whose bytes must survive every sleep, and what it saw."""

    index: int
    tags: list[str] = field(default_factory=list)
    keep: dict[str, torch.Tensor] = field(default_factory=dict)
    keep_host: dict[str, torch.Tensor] = field(default_factory=dict)
    rounds: int = 0
    refused: int = 0
    errors: list[str] = field(default_factory=list)


def _run_worker(alloc: TaggedAllocator, w: Worker, stop: threading.Event) -> None:
    """Allocate and free tensors in this thread's tags (a new tag, hence a new pool, every 40 rounds); no kernels.

    Nothing here touches the memory: a tag may be asleep between two lines, and an
    engine does not run kernels while asleep.
    """
    rng = random.Random(w.index)
    try:
        while not stop.is_set():
            if w.rounds % 40 == 0 and len(w.tags) < 6:
                w.tags.append(f"worker{w.index}.{len(w.tags)}")  # its pool is made in this thread, on first use
            tag = rng.choice(w.tags)
            try:
                with alloc.use_memory_pool(tag):
                    held = [torch.empty(rng.choice(SIZES), dtype=torch.uint8, device="cuda") for _ in range(8)]
                del held[::2]  # frees from this thread; the rest go at the end of the round
                del held
            except (torch.OutOfMemoryError, TorporError):  # the tag is asleep: refused, as documented
                w.refused += 1
            w.rounds += 1
    except Exception as exc:  # reported by the main thread
        w.errors.append(f"{type(exc).__name__}: {exc}")


def _run_stats(stop: threading.Event, counts: list[int], errors: list[str]) -> None:
    """Ask torch for memory stats and empty its cache (freeing tagged segments through the native free) in a loop."""
    try:
        while not stop.is_set():
            torch.cuda.memory_stats()
            torch.cuda.empty_cache()
            counts[0] += 1
            time.sleep(0.002)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")


def test_four_threads_allocate_in_tags_while_the_main_thread_sleeps_and_wakes() -> None:
    """4 threads allocate/free in their own tags (pools made in threads) for 60 s, a fifth calls memory_stats and empty_cache, the main thread computes, sleeps and wakes: no hang, every wake bit-exact."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    seconds = float(os.environ.get("TORPOR_THREADS_SECONDS", "60"))
    faulthandler.dump_traceback_later(seconds + 120, exit=True, file=sys.stderr)  # a hang: every thread's stack
    try:
        torch.manual_seed(0)
        alloc = TaggedAllocator()
        ctl = SleepController(alloc)
        with alloc.use_memory_pool("weights"):
            w = torch.randn(2048, 2048, device="cuda")
        with alloc.use_memory_pool("runtime"):
            x = torch.randn(256, 2048, device="cuda")
        w_host, ref = w.cpu(), (x @ w).cpu()
        stop = threading.Event()
        workers = [Worker(i) for i in range(4)]
        for wk in workers:  # each worker's first tag holds a tensor the main thread checks after every wake
            tag = f"worker{wk.index}.main"
            with alloc.use_memory_pool(tag):
                t = torch.full((1 << 18,), wk.index + 7, dtype=torch.int32, device="cuda")
            wk.tags.append(tag)
            wk.keep[tag], wk.keep_host[tag] = t, t.cpu()
        threads = [threading.Thread(target=_run_worker, args=(alloc, wk, stop), daemon=True) for wk in workers]
        stats_count, stats_errors = [0], []
        threads.append(threading.Thread(target=_run_stats, args=(stop, stats_count, stats_errors), daemon=True))
        for t in threads:
            t.start()
        cycles, computed, deadline = 0, 0, time.monotonic() + seconds
        next_sleep = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            y = x @ w
            computed += 1
            if time.monotonic() >= next_sleep:
                torch.cuda.synchronize()
                assert torch.equal(y.cpu(), ref), "compute drifted while awake"
                ctl.sleep(1)
                assert ctl.state is State.ASLEEP_L1
                ctl.wake()
                assert ctl.state is State.AWAKE
                torch.cuda.synchronize()
                assert torch.equal(w.cpu(), w_host), f"weights changed across wake {cycles + 1}"
                assert torch.equal((x @ w).cpu(), ref), f"compute differs after wake {cycles + 1}"
                for wk in workers:
                    for tag, t in list(wk.keep.items()):
                        assert torch.equal(t.cpu(), wk.keep_host[tag]), f"{tag} changed across wake {cycles + 1}"
                cycles += 1
                next_sleep = time.monotonic() + 2.0
        stop.set()
        for t in threads:
            t.join(60)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            pytest.fail(f"threads {alive} still running 60 s after the stop (hang); stacks above")
        errors = [e for wk in workers for e in wk.errors] + stats_errors
        rounds = [wk.rounds for wk in workers]
        print(
            f"threads: {seconds:.0f} s, {cycles} sleep/wake cycles, {computed} matmuls, worker rounds {rounds}, "
            f"refused while asleep {[wk.refused for wk in workers]}, memory_stats+empty_cache {stats_count[0]}, "
            f"tags {len(alloc.usage())}"
        )
        assert not errors, errors
        assert cycles >= 10 and min(rounds) > 100 and stats_count[0] > 100
        alloc.close()
    finally:
        faulthandler.cancel_dump_traceback_later()
