"""Benchmark (issue 41): an engine killed asleep, its weights resident again: adopted from the keeper, or loaded from disk.

Run on a GPU machine: ``python benchmarks/keeper_adopt.py [--layers 36] [--dir DIR]``.
One process after another, each timed from the moment the driver spawns it:

1. ``torpor keeper serve`` with a 20 GiB budget;
2. the engine: a Qwen3-8B-shaped transformers model (36 layers, hidden 4096, vocab 32000, bf16, random
   weights, seed 0; 14.4 GB) built in tag ``weights``, its state written to a local safetensors file
   (the checkpoint a cold start loads), tracked by the keeper, level-1 asleep, woken, asleep again (the first
   and the later sleep into keeper memory, timed); then ``kill -9``;
3. the adopter: ``torpor.keeper.prefetch`` right after the imports (the backup claimed and pinned while
   the model builds), the same model built again (seed 99, so other values), ``torpor.keeper.adopt``
   copies the engine's backup in; weights resident when it returns (synchronized); then a second engine
   as in 2 (no checkpoint written), killed, and an adopter without the prefetch;
4. the cold starts: the same model built again, ``model.load_state_dict(safetensors.torch.load_file(...))``,
   once with the file in the page cache and once after ``posix_fadvise(DONTNEED)`` evicted it (the
   local disk read, as a restart on a host whose page cache lost the checkpoint).

Every path checks the weights against the engine's checksums (:mod:`torpor.bench.checksums`). The
floor is the weights' bytes over the host link's pinned bandwidth, measured in the adopter's process.
Prints one JSON line per process and a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SOURCE = "Qwen3-8B shape, random bf16 seed 0 (benchmarks/keeper_adopt.py)"
ENGINE = "keeper-bench"


def _config(layers: int) -> Any:
    from torpor.bench import realmodel as rm

    return rm.config(
        "dense",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    )


def _sums(model: Any) -> dict[str, list[int]]:
    from torpor.bench.checksums import module_checksums

    return {k: list(v) for k, v in module_checksums(model).items()}


def _say(**data: Any) -> None:
    print(json.dumps(data), flush=True)


def engine(sock: str, path: str, layers: int) -> None:
    """Build, write the checkpoint (``path``; "-": none), sleep with the keeper, then wait to be killed."""
    import torch
    from safetensors.torch import save_file

    from torpor import SleepController
    from torpor.allocator import TaggedAllocator
    from torpor.bench import realmodel as rm
    from torpor.keeper import attach, track_model

    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    backing = attach(alloc, ctl, keeper=sock, engine=ENGINE)
    with alloc.use_memory_pool("weights"):
        model = rm.build(_config(layers), seed=0)
    track_model(backing, model, SOURCE)
    if path != "-":
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, path)
    sums = _sums(model)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ctl.sleep(1)  # the first sleep maps and pins keeper regions
    t1 = time.perf_counter()
    ctl.wake()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    ctl.sleep(1)  # the later one copies into them
    sleeps, wakes = [t1 - t0, time.perf_counter() - t2], [t2 - t1]
    nbytes = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    _say(role="engine", pid=os.getpid(), bytes=nbytes, sleeps=sleeps, wakes=wakes, sums=sums, **backing.status())
    time.sleep(3600)


def adopter(sock: str, layers: int, prefetched: bool) -> None:
    """Build the model afresh and adopt the dead engine's backup (``prefetched``: claimed and pinned before the build)."""
    t_main = time.time()
    import torch

    from torpor.bench import realmodel as rm
    from torpor.bench.device import measure_floor
    from torpor.keeper import adopt, prefetch, wait_released

    t_import = time.time()
    if prefetched:
        prefetch(keeper=sock, engine=ENGINE, device=torch.cuda.current_device())
    model = rm.build(_config(layers), seed=99)
    torch.cuda.synchronize()
    t_built = time.time()
    adopted = adopt(model, source=SOURCE, keeper=sock, engine=ENGINE)
    torch.cuda.synchronize()
    t_resident = time.time()
    wait_released()
    t_released = time.time()
    _, h2d = measure_floor()
    _say(
        role="adopt, prefetched" if prefetched else "adopt",
        released_s=t_released - t_resident,
        main=t_main,
        imported=t_import,
        built=t_built,
        resident=t_resident,
        adopted=str(adopted),
        adopt_s=adopted.seconds if adopted else None,
        h2d=h2d,
        sums=_sums(model),
    )


def cold(path: str, layers: int, evict: bool) -> None:
    """Build the model afresh and load the checkpoint from local disk (``evict``: out of the page cache first)."""
    t_main = time.time()
    if evict:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    import torch
    from safetensors.torch import load_file

    from torpor.bench import realmodel as rm

    t_import = time.time()
    model = rm.build(_config(layers), seed=99)
    torch.cuda.synchronize()
    t_built = time.time()
    model.load_state_dict(load_file(path))
    torch.cuda.synchronize()
    t_resident = time.time()
    _say(
        role="cold, evicted" if evict else "cold, page cache",
        main=t_main,
        imported=t_import,
        built=t_built,
        resident=t_resident,
        sums=_sums(model),
    )


def _child(args: list[str]) -> dict[str, Any]:
    spawned = time.time()
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False, timeout=900)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        msg = f"{args[0]} failed ({done.returncode}): {done.stderr[-2000:]}"
        raise RuntimeError(msg)
    out: dict[str, Any] = json.loads(lines[-1])
    out["spawned"] = spawned
    return out


def _asleep_and_killed(sock: str, ckpt: str, layers: int) -> dict[str, Any]:
    """An engine process asleep into the keeper, then killed with SIGKILL; its line."""
    eng = subprocess.Popen(
        [sys.executable, __file__, "engine", sock, ckpt, str(layers)], stdout=subprocess.PIPE, text=True
    )
    line = eng.stdout.readline() if eng.stdout else ""
    if not line:
        msg = f"the engine exited ({eng.wait()}) before it slept"
        raise RuntimeError(msg)
    os.kill(eng.pid, signal.SIGKILL)
    eng.wait()
    out: dict[str, Any] = json.loads(line)
    return out


def drive(layers: int, workdir: Path) -> None:
    """The whole benchmark (see the module doc)."""
    workdir.mkdir(parents=True, exist_ok=True)
    sock, ckpt = str(workdir / "keeper.sock"), str(workdir / "model.safetensors")
    keeper_log = workdir / "keeper.log"
    keeper = subprocess.Popen(
        [sys.executable, "-m", "torpor", "keeper", "serve", "--socket", sock, "--budget", "20G"],
        stdout=keeper_log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180  # a freshly started machine imports slowly
        while not os.path.exists(sock) and keeper.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.exists(sock):
            msg = (
                f"the keeper did not come up at {sock} (exit status {keeper.poll()}): {keeper_log.read_text()[-2000:]}"
            )
            raise RuntimeError(msg)
        asleep = _asleep_and_killed(sock, ckpt, layers)
        rows = [_child(["adopt", sock, str(layers), "prefetch"])]
        again = _asleep_and_killed(sock, "-", layers)  # a second engine for the adoption without a prefetch
        rows += [_child(["adopt", sock, str(layers), "plain"])]
        rows += [_child(["cold", ckpt, str(layers), flag]) for flag in ("warm", "evict")]
    finally:
        keeper.kill()
        keeper.wait()
    if again["sums"] != asleep["sums"]:
        msg = "the second engine's weights differ from the first's (same seed): the benchmark's own error"
        raise RuntimeError(msg)
    nbytes = asleep["bytes"]
    floor = nbytes / rows[0]["h2d"]
    first, later = asleep["sleeps"]
    print(
        f"weights {nbytes / 1e9:.2f} GB; floor {floor:.3f} s ({rows[0]['h2d'] / 1e9:.1f} GB/s); the engine's level-1 "
        f"sleeps into the keeper: first {first:.3f} s ({first / floor:.2f}x), later {later:.3f} s "
        f"({later / floor:.2f}x); its wake {asleep['wakes'][0]:.3f} s"
    )
    print("| path | process start to weights resident | of which import | build | weights in | in / floor | exact |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        weights_in = r["resident"] - r["built"]
        exact = "yes" if r["sums"] == asleep["sums"] else "NO"
        print(
            f"| {r['role']} | {r['resident'] - r['spawned']:.2f} s | {r['imported'] - r['spawned']:.2f} s | "
            f"{r['built'] - r['imported']:.2f} s | {weights_in:.3f} s | {weights_in / floor:.2f}x | {exact} |"
        )
    for r in rows:
        if "adopted" in r:
            print(
                f"{r['role']}: {r['adopted']}; adopt() {r['adopt_s']:.3f} s ({r['adopt_s'] / floor:.2f}x the floor); "
                f"unpinned and unmapped on a thread {r['released_s']:.3f} s after"
            )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("engine", "adopt", "cold"):
        role, rest = sys.argv[1], sys.argv[2:]
        if role == "engine":
            engine(rest[0], rest[1], int(rest[2]))
        elif role == "adopt":
            adopter(rest[0], int(rest[1]), rest[2] == "prefetch")
        else:
            cold(rest[0], int(rest[1]), rest[2] == "evict")
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36, help="decoder layers (36: the 8B shape)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="socket and checkpoint (default: a new private temp dir)"
    )
    args = parser.parse_args()
    drive(args.layers, args.dir or Path(tempfile.mkdtemp(prefix="torpor-keeper-bench-")))


if __name__ == "__main__":
    main()
