"""Benchmark: what readers pulling ``/events`` cost the engine that serves them.

An engine (a ``SleepController`` over the simulated memory) holds 10,000
recent events and serves them with ``serve(controller)`` in its own process,
as an engine with the endpoint does. The benchmark times the engine's
``sleep(1)`` + ``wake()`` in blocks without readers and with ``--readers``
local clients (separate processes) pulling ``/events?after=0`` (10,000 events,
about 3 MB) in a loop, alternating the blocks in one run (the readers are
killed after each loaded block and started again for the next, so the blocks
without readers have none), and prints the median and p99 of each, and their
ratio (target: p99 with readers within 3x of p99 without).

Run: python benchmarks/bench_endpoint_load.py [--readers 4] [--cycles 150] [--blocks 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torpor import SleepController
from torpor.telemetry import serve
from torpor.testing import FakeMemory

TAGS = {"weights": 2**34, "kv_cache": 2**35, "cudagraph": 2**31, "runtime": 2**28}
EVENTS = 10_000

_READER = """
import sys, time, urllib.request
url, out = sys.argv[1], sys.argv[2]
pulls = 0
bytes_read = 0
while True:
    with urllib.request.urlopen(url, timeout=60) as r:
        bytes_read += len(r.read())
    pulls += 1
    with open(out, "w") as f:
        f.write(f"{pulls} {bytes_read}")
"""


def cycles(controller: SleepController, n: int) -> list[float]:
    """Seconds per sleep(1) + wake(), ``n`` times."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        controller.sleep(1)
        controller.wake()
        times.append(time.perf_counter() - start)
    return times


def p99(times: list[float]) -> float:
    """The 99th percentile."""
    ordered = sorted(times)
    return ordered[max(0, int(len(ordered) * 0.99) - 1)]


def _pulls(files: list[str]) -> list[int]:
    out = []
    for name in files:
        try:
            with open(name) as fh:
                out.append(int(fh.read().split()[0]))
        except (OSError, ValueError, IndexError):
            out.append(0)
    return out


def main() -> None:
    """Print the figures as Markdown."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=150, help="sleep+wake cycles per block")
    parser.add_argument("--blocks", type=int, default=8, help="blocks of each kind, alternated")
    args = parser.parse_args()
    controller = SleepController(FakeMemory(TAGS), engine="bench", rank=0, keep_events=EVENTS)
    while controller.last_seq < EVENTS:
        controller.observe()
    cycles(controller, 50)  # warm up
    without: list[float] = []
    with_readers: list[float] = []
    pulled = 0
    with serve(controller, max_events=EVENTS) as server:
        url = f"{server.url}/events?after=0"
        scratch = Path(tempfile.mkdtemp(prefix="torpor-bench-"))
        for _ in range(args.blocks):
            without += cycles(controller, args.cycles)
            files = [str(scratch / f"reader-{i}") for i in range(args.readers)]
            readers = [subprocess.Popen([sys.executable, "-c", _READER, url, f]) for f in files]
            try:
                deadline = time.monotonic() + 60
                while min(_pulls(files)) < 2:  # every reader has pulled the whole window (the cache is warm)
                    if time.monotonic() > deadline:
                        msg = "the readers never got their events"
                        raise RuntimeError(msg)
                    time.sleep(0.05)
                before = sum(_pulls(files))
                with_readers += cycles(controller, args.cycles)
                pulled += sum(_pulls(files)) - before
            finally:
                for reader in readers:
                    reader.kill()
                    reader.wait()
                time.sleep(0.2)  # the server notices the hang-ups before the next block without readers
                for name in files:
                    Path(name).unlink(missing_ok=True)
        scratch.rmdir()
    base, loaded = p99(without), p99(with_readers)
    print(f"python {platform.python_version()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"load average {os.getloadavg()[0]:.2f}, date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print(f"## Engine sleep(1)+wake() with {args.readers} readers pulling /events?after=0 ({EVENTS} events)\n")
    print(
        f"{args.blocks} blocks of {args.cycles} cycles each way, alternated; {pulled} full pulls during the loaded blocks\n"
    )
    print("| readers | median | p99 |")
    print("| --- | --- | --- |")
    print(f"| none | {statistics.median(without) * 1e3:.3f} ms | {base * 1e3:.3f} ms |")
    print(f"| {args.readers} | {statistics.median(with_readers) * 1e3:.3f} ms | {loaded * 1e3:.3f} ms |")
    verdict = "met" if loaded <= 3 * base else "not met"
    print(f"\np99 with readers / p99 without: {loaded / base:.2f}x (target <= 3x: {verdict})")


if __name__ == "__main__":
    main()
