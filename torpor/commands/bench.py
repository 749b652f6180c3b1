"""``torpor bench``: sleep/wake benchmark of torpor against a vLLM-style loop and torch_memory_saver (needs a GPU)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from torpor import bench as benchmark
from torpor.bench import realmodel, tmsbackends
from torpor.bench import vllm as vllm_bench
from torpor.errors import BadArgument
from torpor.extras import require


def _backends(text: str) -> tuple[str, ...]:
    """``--tms-backends``: a comma-separated list; an unknown name is argparse's usage error naming the valid ones."""
    try:
        return tmsbackends.parse_backends(text)
    except BadArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``bench`` subcommand."""
    p = sub.add_parser(
        "bench",
        help="benchmark sleep and wake against the host-link floor (needs a CUDA GPU)",
        description=(
            "Run torpor, a vLLM-style baseline and torch_memory_saver (when importable) side by side on "
            "8 GiB in 64 allocations, 4 GiB in 2048 x 2 MiB, a small transformer's graph pool and a real "
            "transformers model (weights, graph, KV block); "
            "write bench.json and bench.md."
        ),
        epilog="example: torpor bench --out out/bench > bench.md   (progress on stderr; then: python benchmarks/plot_bench.py out/bench/bench.json)",
    )
    p.add_argument("--cycles", type=int, default=4, help="sleep/wake cycles per workload (default 4)")
    p.add_argument("--no-sweep", action="store_true", help="skip the byte and segment sweeps used by the plots")
    p.add_argument("--no-tms", action="store_true", help="skip torch_memory_saver even when importable")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT or out/bench)")
    p.add_argument(
        "--real-model",
        action="store_true",
        help="only the real-model rows: a Qwen3-1.7B-shaped transformers model (random weights), its graph and "
        "a 2 GiB KV block on torpor, the vLLM-style loop, and torpor.tms and torch_memory_saver on each "
        "--tms-backends backend (needs transformers)",
    )
    p.add_argument(
        "--tms-backends",
        type=_backends,
        default=tmsbackends.TMS_BACKENDS,
        metavar="LIST",
        help="the real-model rows' torch_memory_saver backup backends, comma-separated, each run on torpor.tms "
        f"then torch_memory_saver (default {','.join(tmsbackends.TMS_BACKENDS)})",
    )
    p.add_argument(
        "--tms-disk-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the disk backend writes its backups in a fresh folder under DIR, removed after the run "
        f"(default {tmsbackends.DEFAULT_DISK_PARENT}; tmpfs and ramfs refused: their files are in RAM)",
    )
    p.add_argument(
        "--vllm",
        metavar="MODEL",
        help="instead: vLLM's cumem sleep backend against torpor on MODEL (a local directory), "
        "engines in alternating order (torpor.bench.vllm; needs vllm)",
    )
    p.add_argument("--vllm-rounds", type=int, default=2, help="engines per backend with --vllm (default 2)")
    p.add_argument("--vllm-first", choices=["cumem", "torpor"], default="cumem", help="with --vllm: which starts first")
    p.add_argument(
        "--vllm-mode",
        choices=["compile", "graphs", "eager"],
        default="compile",
        help="with --vllm: torch.compile + CUDA graphs (default), CUDA graphs without compile, or eager",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and write its results."""
    torch = require("torch", "the benchmark")  # the CLI prefixes "torpor bench: "
    if not torch.cuda.is_available():
        print("torpor bench: no CUDA device here; run it on a GPU machine (docs/allocator.md)", file=sys.stderr)
        return 1  # the command cannot run here: not a usage error (2), see docs/cli.md
    out = args.out or Path(os.environ.get("OUT") or "out/bench")
    out.mkdir(parents=True, exist_ok=True)
    if args.vllm:
        require("vllm", "the vLLM bench (--vllm)", extra="vllm")
        data_vllm = vllm_bench.run(
            args.vllm,
            rounds=args.vllm_rounds,
            cycles=args.cycles,
            mode=args.vllm_mode,
            first=args.vllm_first,
            out=out,
            log=lambda s: print(s, file=sys.stderr, flush=True),
        )
        print(vllm_bench.markdown(data_vllm))
        return 0 if all(row["ok"] for row in data_vllm["summary"].values()) else 1

    def save(data: dict[str, object]) -> None:
        (out / "bench.json").write_text(json.dumps(data, indent=1, default=str))
        (out / "bench.md").write_text(benchmark.markdown(data))

    if args.real_model:
        require("transformers", "the real-model rows (--real-model)", extra="vllm")  # vLLM brings transformers
        data_model = realmodel.report(
            args.cycles,
            not args.no_tms,
            log=lambda s: print(s, file=sys.stderr, flush=True),
            backends=args.tms_backends,
            disk_parent=args.tms_disk_dir,
        )
        save(data_model)
        print(benchmark.markdown(data_model))
        return 0

    data = benchmark.run(
        cycles=args.cycles,
        sweep=not args.no_sweep,
        tms=not args.no_tms,
        log=lambda s: print(s, file=sys.stderr, flush=True),  # progress; stdout is the report alone
        save=save,
        tms_backends=args.tms_backends,
        disk_dir=args.tms_disk_dir,
    )
    save(data)
    print(benchmark.markdown(data))
    return 0
