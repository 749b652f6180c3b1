"""Benchmark: the controller's command path (the guard every command goes through), per command.

Run: python benchmarks/bench_guard.py [--cycles 300]

Three loops, each timed in CPU seconds (best of fifteen, so a loaded machine inflates
nothing), with no log (events kept in memory only) so the figure is the command
path itself:

- ``sim``: ``sleep(1)`` / ``wake()`` cycles on a :class:`~torpor.allocator.TaggedAllocator`
  over the simulated device (:class:`~torpor.allocator.SimDriver`), 4 tags of one
  small allocation each: the guard, the plan, the allocator's calls, the events;
- ``fake``: the same cycles on :class:`~torpor.testing.FakeMemory` (no memory work at all);
- ``refusals``: commands the table refuses (``wake`` while awake, ``recover`` while
  awake, ``capture`` and ``release_cudagraph_pool`` while asleep), each recorded as a
  ``refused`` event: the guard and the refusal path alone, on ``FakeMemory``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

from torpor import SleepController
from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
from torpor.errors import TorporError
from torpor.testing import FakeMemory

G = 64 * 1024
MiB = 1 << 20


def _best(run: Callable[[], int], repeats: int = 15) -> float:
    """Lowest CPU seconds per command over ``repeats`` runs of ``run`` (which returns its command count)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        n = run()
        best = min(best, (time.process_time() - start) / n)
    return best


def sim_cycles(cycles: int) -> float:
    """CPU seconds per command of sleep(1)/wake() on the simulated allocator."""
    sim = SimDriver(256 * MiB, granularity=G)
    alloc = TaggedAllocator(sim, host=HostPolicy(prepin=True, chunk_bytes=MiB, threads=1), slab_bytes=8 * G)
    for tag in ("weights", "kv_cache", "cudagraph", "runtime"):
        alloc.allocate(G, tag)
    ctl = SleepController(alloc, keep_events=1000)

    return _best(_sleep_wake(ctl, cycles))


def _sleep_wake(ctl: SleepController, cycles: int) -> Callable[[], int]:
    """A run of ``cycles`` sleep(1)/wake() pairs on ``ctl``, returning the commands it ran."""

    def run() -> int:
        for _ in range(cycles):
            ctl.sleep(1)
            ctl.wake()
        return 2 * cycles

    return run


def fake_cycles(cycles: int) -> float:
    """CPU seconds per command of sleep(1)/wake() on FakeMemory."""
    ctl = SleepController(
        FakeMemory({"weights": 2**30, "kv_cache": 2**31, "cudagraph": 2**26, "runtime": 2**20}), keep_events=1000
    )

    return _best(_sleep_wake(ctl, cycles))


def refusals(cycles: int) -> float:
    """CPU seconds per refused command (guard, ``refused`` event, the error raised)."""
    ctl = SleepController(FakeMemory({"weights": 2**30, "cudagraph": 2**26}), keep_events=1000)
    awake: list[Callable[[], object]] = [ctl.wake, ctl.recover]
    asleep: list[Callable[[], object]] = [ctl.release_cudagraph_pool, lambda: ctl.capture("site").__enter__()]

    def run() -> int:
        n = 0
        for commands in (awake, asleep):
            if commands is asleep:
                ctl.sleep(1)
            for _ in range(cycles):
                for command in commands:
                    try:
                        command()
                    except TorporError:
                        n += 1
            if commands is asleep:
                ctl.wake()
        return n

    return _best(run)


def main() -> None:
    """Print the figures as a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print("| loop | µs per command (CPU, best of 15) |")
    print("| --- | --- |")
    print(f"| sleep(1)/wake() on TaggedAllocator + SimDriver | {sim_cycles(args.cycles) * 1e6:.1f} |")
    print(f"| sleep(1)/wake() on FakeMemory | {fake_cycles(args.cycles) * 1e6:.1f} |")
    print(f"| refused commands (FakeMemory) | {refusals(args.cycles) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
