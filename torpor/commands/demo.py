"""``torpor demo``: the whole product in one command, on a GPU when there is one, on the simulated device when not."""

from __future__ import annotations

import argparse
from pathlib import Path

from torpor.demo import DEVICES, DemoOptions, run_demo

#: The highest TCP port.
MAX_PORT = 65535


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser(
        "demo",
        help="sleep and wake a model-like workload and watch it (GPU, or the simulated device)",
        description="Put a model-like workload (weights, kv_cache, CUDA graphs per batch size) to sleep and "
        "wake it: level 1 full wake, level 1 selective wake (weights, then kv_cache), level 2 with a weight "
        "reload. Checks every wake bit-exact, serves Prometheus metrics on loopback, writes the event log, "
        "a timeline PNG and the Grafana dashboard. Uses CUDA when available, else the simulated device.",
        epilog="example: torpor demo --cycles 3 --device sim --port 0   (or --keep-serving --host 0.0.0.0 --port 9400)",
    )
    p.add_argument(
        "--cycles", type=cycles, default=3, metavar="N", help="sleep/wake cycles to run (3 covers each kind)"
    )
    p.add_argument("--device", choices=DEVICES, default="auto", help="auto: cuda if available, else sim (default)")
    p.add_argument("--port", type=port, default=0, help="metrics port (0: any free port, the default)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address the metrics endpoint binds (default 127.0.0.1; 0.0.0.0 for a Prometheus on another host)",
    )
    p.add_argument("--log-dir", type=Path, metavar="DIR", help="where the event log goes (default: a new temp dir)")
    p.add_argument(
        "--keep-serving", action="store_true", help="keep the metrics endpoint up after the cycles, until Ctrl-C"
    )
    p.set_defaults(func=run)


def cycles(text: str) -> int:
    """``--cycles N``: a whole number >= 1 (``0`` and ``-1`` exited 1 as a failure, not 2 as the usage error they are)."""
    try:
        value = int(text)
    except ValueError:
        msg = f"{text!r} is not a whole number of cycles (at least 1)"
        raise argparse.ArgumentTypeError(msg) from None
    if value < 1:
        msg = f"{text!r} is not a number of cycles: give at least 1"
        raise argparse.ArgumentTypeError(msg)
    return value


def port(text: str) -> int:
    """``--port PORT``: a TCP port, 0 (any free port) to 65535 (``99999`` and ``-1`` exited 1, not 2)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_PORT:
        msg = f"{text!r} is not a port: give 0 (any free port) to {MAX_PORT}"
        raise argparse.ArgumentTypeError(msg)
    return value


def run(args: argparse.Namespace) -> int:
    """Run the demo with the parsed options."""
    opts = DemoOptions(
        cycles=args.cycles,
        device=args.device,
        port=args.port,
        host=args.host,
        log_dir=args.log_dir,
        keep_serving=args.keep_serving,
    )
    return run_demo(opts)
