"""Two GPUs: an NCCL all-reduce captured in a CUDA graph inside the cuMem pool survives a level-1 sleep and wake.

Each test starts two worker processes (this file run as a script, one per GPU).
Each worker applies the hooks' NCCL default before ``init_process_group``,
captures ``all_reduce(weights * 2)`` into the cuMem graph pool through
``torpor.hooks.capture_pool`` on a ``SleepController`` over the real
``TaggedAllocator``, then runs the RL sequence (sleep level 1, wake weights,
push new weights, wake kv_cache) and replays the graph. NVLink multicast stays
off in the workers (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import support

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2
N = 1 << 20  # elements per tensor (4 MiB of float32)
WORKER_TIMEOUT = 120  # seconds; a healthy run takes a small part of it
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# -- the worker (runs in a child process) ------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _worker(rank: int, port: int, logdir: str, mode: str, result: dict[str, Any]) -> None:
    """The worker's steps; ``result`` fills in as they pass, so a failure shows how far it got."""
    warnings = _Collect()
    logging.getLogger("torpor.hooks").addHandler(warnings)

    def say(step: str) -> None:
        print(f"[rank {rank}] {step}", flush=True)  # progress in the worker's log

    from torpor.hooks import apply_nccl_defaults, capture_pool, cudagraph_pool_decision, set_nccl_graph_pool_hook
    from torpor.hooks.predicate import detect_platform

    decision = cudagraph_pool_decision(True, True, "torpor", True, detect_platform())
    nccl = apply_nccl_defaults(decision)  # before any communicator exists
    result.update(
        rank=rank,
        active=decision.active,
        missing=list(decision.missing),
        nccl_action=nccl.action,
        nccl_env=os.environ.get("NCCL_GRAPH_REGISTER"),
        warnings=warnings.messages,
    )

    import torch
    import torch.distributed as dist

    from torpor.allocator import TaggedAllocator
    from torpor.statemachine import SleepController, State

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, device_id=device
    )
    say("process group up")
    warm = torch.ones(4, device=device)
    dist.all_reduce(warm)
    torch.cuda.synchronize()
    result["eager_warmup"] = warm.tolist()
    if mode == "register1":
        dist.destroy_process_group()
        return

    say("eager all-reduce done")
    allocator = TaggedAllocator()
    ctl = SleepController(allocator, log=logdir + "/", engine="gpu2", rank=rank, fsync=False)  # a directory
    cudagraph_pool_decision(True, True, "torpor", True, detect_platform(), controller=ctl)
    apply_nccl_defaults(decision, controller=ctl)  # already set: recorded as kept
    hooked: list[str] = []
    set_nccl_graph_pool_hook(lambda pool: hooked.append(str(pool)))

    with allocator.use_memory_pool("weights"):
        weights = torch.full((N,), float(rank + 1), device=device)
    with allocator.use_memory_pool("kv_cache"):
        kv = torch.zeros(4 * N, device=device)
    torch.cuda.synchronize()

    say("tensors allocated in the tagged pools")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up the op on a side stream, as torch's capture docs advise
        probe = weights * 2.0
        dist.all_reduce(probe)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize()
    # thread_local: the allocator's pinning thread may call the driver while this thread captures
    say("side-stream warm-up done")
    mode = "thread_local"
    with capture_pool(decision, "allreduce", controller=ctl, plain_pool=None) as pool:
        if hasattr(pool, "graph"):  # the allocator's handle: records the graph as a pool holder
            ctx = pool.graph(graph, capture_error_mode=mode)
        else:
            ctx = torch.cuda.graph(graph, pool=pool, capture_error_mode=mode)
        with ctx:
            out = weights * 2.0
            dist.all_reduce(out)
    say("captured")
    result["hooked"] = hooked
    result["pool"] = str(ctl.projection.pool)
    result["pool_id"] = str(allocator.cudagraph_pool_id())
    graph_usage = ctl.projection.residency.get("cudagraph")
    result["graph_bytes"] = graph_usage.resident if graph_usage is not None else 0

    def replay() -> list[float]:
        graph.replay()
        torch.cuda.synchronize()
        return [float(out.min()), float(out.max())]

    result["before"] = replay()  # 2 * (1 + 2) = 6 on both ranks
    say("replayed before sleep")
    result["host_ready"] = allocator.wait_host_ready(60)
    from cuda.bindings import driver as cu

    other = cu.cuDeviceGet(1 - rank)[1]
    result["context_on_other_gpu"] = bool(cu.cuDevicePrimaryCtxGetState(other)[2])  # pinning made none there

    states: list[str] = []
    result["states"] = states
    ctl.sleep(1)
    states.append(ctl.state.value)
    asleep = ctl.projection.residency
    result["asleep"] = {
        t: {"resident": u.resident, "host": u.host, "discarded": u.discarded} for t, u in asleep.items()
    }
    say("asleep")
    dist.barrier(device_ids=[rank])
    ctl.wake(["weights"])
    states.append(ctl.state.value)
    weights.fill_(float(rank + 2))  # push the trained weights
    ctl.wake(["kv_cache"])
    states.append(ctl.state.value)
    kv.fill_(1.0)
    result["kv_sum"] = float(kv.sum())
    dist.barrier(device_ids=[rank])
    result["after_rl_wake"] = replay()  # 2 * (2 + 3) = 10
    say("replayed after the RL wake")

    ctl.sleep(1)
    states.append(ctl.state.value)
    ctl.wake()
    states.append(ctl.state.value)
    dist.barrier(device_ids=[rank])
    result["after_full_wake"] = replay()
    result["awake"] = ctl.wait_for(State.AWAKE, timeout=1)
    result["warnings"] = warnings.messages
    dist.barrier(device_ids=[rank])
    say("replayed after the full wake")
    # teardown: a live graph that captured an NCCL collective holds the communicator, and
    # destroy_process_group() then waits for ever (seen on the H200 x2): drop the graph first
    graph.reset()
    torch.cuda.synchronize()
    dist.destroy_process_group()
    say("process group destroyed")


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--mode", choices=["run", "register1"], default="run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    # a hung worker prints every thread's Python stack and exits before the parent's kill
    faulthandler.dump_traceback_later(WORKER_TIMEOUT - 30, exit=True)
    try:
        _worker(args.rank, args.port, args.logdir, args.mode, result)
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        Path(args.out).write_text(json.dumps(result))
    return 0


# -- the tests (run by pytest in the parent) ----------------------------------------------


def _spawn(tmp_path: Path, mode: str, extra_env: dict[str, str]) -> tuple[list[dict[str, Any]], list[int], str]:
    """Run the two workers; their results, exit codes and output tails (fails when a result is missing)."""
    env = {k: v for k, v in os.environ.items() if k != "NCCL_GRAPH_REGISTER"}
    env.update(NO_MULTICAST)
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("NCCL_DEBUG", "INFO")  # NCCL then logs the NCCL_* values it read from the environment
    env.setdefault("NCCL_DEBUG_SUBSYS", "ENV")
    port = support.free_port()
    logdir = tmp_path / "logs"
    procs = []
    for rank in range(WORLD):
        cmd = [sys.executable, __file__, "--rank", str(rank), "--port", str(port), "--logdir", str(logdir)]
        cmd += ["--mode", mode, "--out", str(tmp_path / f"rank{rank}.json")]
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115  (closed below)
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=WORKER_TIMEOUT))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            codes.append(-9)
        finally:
            log.close()
    outputs = "\n".join(
        f"--- rank {r} (exit {c}):\n" + (tmp_path / f"rank{r}.log").read_text()[-8000:] for r, c in enumerate(codes)
    )
    missing = [r for r in range(WORLD) if not (tmp_path / f"rank{r}.json").exists()]
    if missing:
        pytest.fail(f"workers {missing} wrote no result:\n{outputs}")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(json.dumps(results, indent=1))
    for r in range(WORLD):  # what NCCL itself says it read (evidence for the record, not asserted)
        said = [line for line in (tmp_path / f"rank{r}.log").read_text().splitlines() if "GRAPH_REGISTER" in line]
        print(f"rank {r} NCCL:", said or "no NCCL_GRAPH_REGISTER line")
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        pytest.fail(f"workers failed ({'; '.join(errors)}); results so far: {json.dumps(results)}\n{outputs}")
    return results, codes, outputs


@pytest.mark.gpu2
def test_captured_allreduce_replays_right_after_level1_sleep_and_wake(tmp_path: Path) -> None:
    """Both ranks: NCCL default applied, all-reduce graph in the cuMem pool replays the right sums after the RL wake."""
    results, codes, outputs = _spawn(tmp_path, "run", {})
    for r in results:
        assert r["active"], r["missing"]
        assert (r["nccl_action"], r["nccl_env"]) == ("set", "0")
        assert r["warnings"] == []
        assert r["eager_warmup"] == [2.0] * 4
        assert r["hooked"] == [r["pool_id"]]  # NCCL's graph allocator was pointed at the cuMem graph pool
        assert r["pool"] == "cudagraph-pool-" + r["pool_id"].strip("()").replace(", ", ".")
        assert r["graph_bytes"] > 0
        assert r["before"] == [6.0, 6.0]
        assert r["context_on_other_gpu"] is False
        assert r["asleep"]["weights"]["host"] > 0
        assert r["asleep"]["kv_cache"]["discarded"] > 0
        assert r["asleep"]["cudagraph"]["host"] > 0
        assert r["asleep"]["cudagraph"]["resident"] == 0
        assert r["states"] == ["asleep_l1", "partially_awake", "awake", "asleep_l1", "awake"]
        assert r["kv_sum"] == 4.0 * N
        assert r["after_rl_wake"] == [10.0, 10.0]
        assert r["after_full_wake"] == [10.0, 10.0]
        assert r["awake"]

    from torpor.hooks import fleet
    from torpor.statemachine import read_events

    assert fleet(tmp_path / "logs").engine("gpu2").state == "awake"
    decisions = [
        e.data["detail"]
        for e in read_events(tmp_path / "logs" / "gpu2.rank0.jsonl")
        if e.kind.value == "hook_decision" and e.data["hook"] == "nccl_graph_register"
    ]
    assert decisions == ["cuMem graph pool active: kept explicit NCCL_GRAPH_REGISTER=0"]
    assert codes == [0] * WORLD, f"workers exited badly after writing correct results:\n{outputs}"


@pytest.mark.gpu2
def test_explicit_graph_register_is_kept_with_the_warning(tmp_path: Path) -> None:
    """With NCCL_GRAPH_REGISTER=1 set explicitly, both ranks keep it and log the danger warning."""
    results, codes, outputs = _spawn(tmp_path, "register1", {"NCCL_GRAPH_REGISTER": "1"})
    for r in results:
        assert (r["nccl_action"], r["nccl_env"]) == ("kept", "1")
        assert len(r["warnings"]) == 1
        assert "NCCL_GRAPH_REGISTER=1" in r["warnings"][0]
        assert "dangerous" in r["warnings"][0]
        assert r["eager_warmup"] == [2.0] * 4
    assert codes == [0] * WORLD, outputs


if __name__ == "__main__":
    sys.exit(_main())
