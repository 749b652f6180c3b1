"""Benchmark: controller bookkeeping per transition (fsync off/on) and replay throughput.

Run: python benchmarks/bench_statemachine.py [--events 100000]
Memory is torpor.testing.FakeMemory, so the figures are torpor's own cost: the
state machine, the event records, the log append and the projection fold.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

from torpor import SleepController, replay
from torpor.statemachine.core.events import EventKind, make_event
from torpor.statemachine.log.eventlog import EventLog
from torpor.testing import FakeMemory

TAGS = {"weights": 2**34, "kv_cache": 2**35, "cudagraph": 2**31, "runtime": 2**28, "workspace": 2**27, "lora": 2**26}


def per_transition(directory: Path, fsync: bool, cycles: int) -> tuple[float, int]:
    """Seconds per state transition and events per cycle for sleep(1)/wake() cycles."""
    ctl = SleepController(FakeMemory(TAGS), log=EventLog(directory / f"t-{fsync}.jsonl", fsync=fsync))
    start_seq = ctl.last_seq
    start = time.perf_counter()
    for _ in range(cycles):
        ctl.sleep(1)
        ctl.wake()
    elapsed = time.perf_counter() - start
    return elapsed / (cycles * 4), (ctl.last_seq - start_seq) // cycles


def replay_rate(directory: Path, n: int) -> tuple[float, float]:
    """Events per CPU-second replayed from a log of ``n`` events: (best, worst) of five runs."""
    path = directory / "replay.jsonl"
    log = EventLog(path, fsync=False, max_bytes=1 << 40)
    ctl = SleepController(FakeMemory(TAGS), log=log)
    while ctl.last_seq < n - 40:
        ctl.sleep(1)
        ctl.wake()
    while log.last_seq < n:
        log.append(make_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))
    log.close()
    runs = []
    for _ in range(5):
        start = time.process_time()  # CPU seconds: a loaded machine inflates wall time, not this
        proj = replay(path)
        runs.append(time.process_time() - start)
        if proj.last_seq != log.last_seq:
            msg = f"replayed {proj.last_seq} events, expected {n}"
            raise RuntimeError(msg)
    return n / min(runs), n / max(runs)


def main() -> None:
    """Print the figures as a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--cycles", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        off, per_cycle = per_transition(d, False, args.cycles)
        on, _ = per_transition(d, True, max(20, args.cycles // 10))
        rate, worst = replay_rate(d, args.events)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(f"events per sleep+wake cycle (6 tags): {per_cycle}")
    print("| measure | figure | target |")
    print("| --- | --- | --- |")
    print(f"| per transition, fsync off | {off * 1e3:.3f} ms | <= 1 ms |")
    print(f"| per transition, fsync on | {on * 1e3:.3f} ms | (disk-bound) |")
    print(
        f"| replay, {args.events} events | {rate:,.0f} events per CPU-second"
        f" (best of 5; worst {worst:,.0f}) | >= 100,000 events/s |"
    )


if __name__ == "__main__":
    main()
