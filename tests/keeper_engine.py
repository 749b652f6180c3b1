"""An engine process for the keeper tests: a small torch model on the simulated device, a keeper, one sleep, then a wait.

Usage: ``python tests/keeper_engine.py SOCKET ENGINE SEED [--width N] [--source S] [--log PATH]``. It prints one JSON
line once asleep (its pid, the backup's id, the keeper bytes) and waits to be killed. The helpers build the same
model in the test process (:func:`tiny_model`); a keeper process is :mod:`keeper_process`'s (:func:`start_keeper`,
imported here too), which needs no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from keeper_process import running_keeper, start_keeper

__all__ = ["SOURCE", "Tiny", "running_keeper", "start_engine", "start_keeper", "tensor_bytes", "tiny_model"]

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "tests/tiny-model@1"


class Tiny(torch.nn.Module):
    """Two wide linear layers (4 MiB each at width 1024), a norm, a head, and a non-persistent buffer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.down = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 96, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=False)


def tiny_model(seed: int, width: int = 1024) -> Tiny:
    """The model of ``seed``: every value from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    model = Tiny(width)
    with torch.no_grad():
        model.scale.mul_(float(seed % 7 + 1))
    return model


def tensor_bytes(model: torch.nn.Module) -> dict[str, bytes]:
    """Every parameter's and buffer's bytes, by name."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return out


def start_engine(sock: Path, engine: str, seed: int, *extra: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """This script in its own process; its line once asleep."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__)), str(sock), engine, str(seed), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        msg = f"the engine exited before it slept: {proc.stderr.read() if proc.stderr else ''}"
        raise RuntimeError(msg)
    return proc, json.loads(line)


def main() -> None:
    from torpor import SleepController
    from torpor.allocator import TaggedAllocator
    from torpor.allocator.host.offload import HostPolicy
    from torpor.allocator.native.sim_driver import SimDriver
    from torpor.keeper import attach, identity_of

    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("engine")
    parser.add_argument("seed", type=int)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--source", default=SOURCE)
    parser.add_argument("--log")
    parser.add_argument(
        "--split", action="store_true", help="a first cycle, then tensors whose backups span two regions"
    )
    args = parser.parse_args()

    model = tiny_model(args.seed, args.width)
    sim = SimDriver(256 << 20)
    alloc = TaggedAllocator(sim, host=HostPolicy(chunk_bytes=2 << 20))
    ctl = SleepController(alloc, log=args.log)
    backing = attach(alloc, ctl, keeper=args.socket, engine=args.engine)
    addresses = {}
    later: dict[str, bytes] = {}
    spare = None
    for name, data in tensor_bytes(model).items():
        if args.split and not name.startswith("up."):
            later[name] = data  # allocated after a first cycle: their backups start in its region, go on in a new one
            continue
        addresses[name] = alloc.allocate(len(data), tag="weights")
        alloc.write(addresses[name], data)
    if args.split:
        spare = alloc.allocate(2 << 20, tag="weights")
        ctl.sleep(1)
        ctl.wake()
        alloc.free(spare)
        for name, data in later.items():
            addresses[name] = alloc.allocate(len(data), tag="weights")
            alloc.write(addresses[name], data)
    kv = alloc.allocate(4 << 20, tag="kv_cache")
    alloc.write(kv, b"\x07" * (4 << 20))
    backing.track(identity_of(model, args.source), addresses)
    ctl.sleep(1)
    print(json.dumps({"pid": os.getpid(), "backup": backing.backup, **backing.status()}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
