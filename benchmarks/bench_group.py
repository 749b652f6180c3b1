"""The cost of group agreement per collective command, on CPU, with 2 and 4 ranks (torch.distributed, TorchGroup).

Each rank is a process with a ``SleepController`` over ``FakeMemory`` (so the
figures are torpor's own bookkeeping, not memory traffic). It runs the same
sleep/wake cycles twice: alone, and in a group over the gloo world group
(votes through the group's TCP store). Reported per command: the median and
p99 of the vote exchange (the ``seconds`` of each ``group_agreed`` event) and
the median command time alone and in the group, whose difference is what a
group costs a command. Usage: ``python benchmarks/bench_group.py [--worlds 2 4] [--cycles 200]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TAGS = {"weights": 1 << 30, "kv_cache": 1 << 29, "cudagraph": 1 << 26, "runtime": 1 << 24}


def _times(ctl: Any, cycles: int, sync: Any) -> list[float]:
    """Seconds of each command (sleep, wake, sleep, ...) over ``cycles`` cycles."""
    out = []
    for _ in range(cycles):
        for command in (lambda: ctl.sleep(1), ctl.wake):
            sync()
            start = time.perf_counter()
            command()
            out.append(time.perf_counter() - start)
    return out


def _worker(rank: int, world: int, port: int, cycles: int, out: Path) -> None:
    import torch.distributed as dist

    from torpor.statemachine import EventKind, SleepController
    from torpor.testing import FakeMemory

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(60)
    )
    sync = dist.barrier  # every rank starts each command together, as an executor's fan-out does
    alone = SleepController(FakeMemory(TAGS), keep_events=100_000)
    _times(alone, 10, sync)  # warm up
    solo = _times(alone, cycles, sync)
    grouped = SleepController(FakeMemory(TAGS), keep_events=100_000, group=dist.group.WORLD)
    _times(grouped, 10, sync)
    after = grouped.last_seq
    group = _times(grouped, cycles, sync)
    votes = [e.data["seconds"] for e in grouped.events(after) if e.kind is EventKind.GROUP_AGREED]
    if rank == 0:
        out.write_text(json.dumps({"solo": solo, "group": group, "votes": votes}))
    dist.barrier()
    dist.destroy_process_group()


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _run(world: int, cycles: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        args = ["--world", str(world), "--port", str(port), "--cycles", str(cycles), "--out", str(out)]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *args], env=env) for r in range(world)]
        for p in procs:
            p.wait(timeout=600)
        raw = json.loads(out.read_text())
    solo, group, votes = raw["solo"], raw["group"], raw["votes"]
    return {
        "world": world,
        "commands": len(group),
        "vote_median_ms": statistics.median(votes) * 1e3,
        "vote_p99_ms": _pct(votes, 0.99) * 1e3,
        "command_alone_median_ms": statistics.median(solo) * 1e3,
        "command_group_median_ms": statistics.median(group) * 1e3,
        "overhead_median_ms": (statistics.median(group) - statistics.median(solo)) * 1e3,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _worker(args.rank, args.world, args.port, args.cycles, Path(args.out))
        return 0
    print(f"# {platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| ranks | commands | vote median | vote p99 | command alone | command in group | group cost |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for world in args.worlds:
        r = _run(world, args.cycles)
        print(
            f"| {world} | {r['commands']} | {r['vote_median_ms']:.3f} ms | {r['vote_p99_ms']:.3f} ms "
            f"| {r['command_alone_median_ms']:.3f} ms | {r['command_group_median_ms']:.3f} ms "
            f"| {r['overhead_median_ms']:.3f} ms |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
