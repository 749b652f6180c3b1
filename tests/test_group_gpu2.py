"""Two GPUs as one group: rank 1's wake fails on a full GPU, both ranks stay asleep intact, then wake and replay.

The test starts two worker processes (this file run as a script, one per
GPU), each with a ``SleepController`` over the real ``TaggedAllocator`` whose
group is the NCCL world group (torpor's votes go through the group's store,
not through NCCL). Each captures ``all_reduce(weights * 2)`` in the cuMem
graph pool and sleeps at level 1. Rank 1 then fills its GPU with an ordinary
torch tensor, so its wake cannot map its memory back: both ranks must raise
``GroupFailed`` naming rank 1 and end asleep with their backups intact. Rank 1
frees the filler, the group wakes, the weights are what they were, and the
captured all-reduce graph replays the right sum. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
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
WORKER_TIMEOUT = 150
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _worker(rank: int, port: int, logdir: str, result: dict[str, Any]) -> None:
    def say(step: str) -> None:
        print(f"[rank {rank}] {step}", flush=True)

    from torpor.hooks import apply_nccl_defaults, capture_pool, cudagraph_pool_decision
    from torpor.hooks.predicate import detect_platform

    decision = cudagraph_pool_decision(True, True, "torpor", True, detect_platform())
    apply_nccl_defaults(decision)  # before any communicator exists

    import torch
    import torch.distributed as dist

    from torpor.allocator import TaggedAllocator
    from torpor.errors import GroupFailed
    from torpor.statemachine import SleepController, State

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, device_id=device
    )
    warm = torch.ones(4, device=device)
    dist.all_reduce(warm)
    torch.cuda.synchronize()
    say("process group up")

    allocator = TaggedAllocator()
    ctl = SleepController(
        allocator, log=logdir + "/", engine="tp2", rank=rank, fsync=False, group=dist.group.WORLD, group_timeout=60
    )
    with allocator.use_memory_pool("weights"):
        weights = torch.full((N,), float(rank + 1), device=device)
    with allocator.use_memory_pool("kv_cache"):
        kv = torch.zeros(4 * N, device=device)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        probe = weights * 2.0
        dist.all_reduce(probe)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize()
    with capture_pool(decision, "allreduce", controller=ctl, plain_pool=None) as pool:
        ctx = (
            pool.graph(graph, capture_error_mode="thread_local")
            if hasattr(pool, "graph")
            else torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
        )
        with ctx:
            out = weights * 2.0
            dist.all_reduce(out)

    def replay() -> list[float]:
        graph.replay()
        torch.cuda.synchronize()
        return [float(out.min()), float(out.max())]

    result["before"] = replay()  # 2 * (1 + 2) = 6
    allocator.wait_host_ready(60)
    ctl.sleep(1)
    result["asleep"] = ctl.state.value
    result["host_asleep"] = {t: u.host for t, u in ctl.projection.residency.items()}
    say("asleep")

    filler = None
    if rank == 1:  # a trainer's tensor takes the GPU: the wake cannot map its memory back
        free, _ = torch.cuda.mem_get_info(device)
        filler = torch.empty(free - (8 << 20), dtype=torch.uint8, device=device)  # 8 MiB left: less than the wake needs
        result["filled_gib"] = filler.numel() / 2**30
        result["free_after_fill_mib"] = torch.cuda.mem_get_info(device)[0] / 2**20
    try:
        ctl.wake()
        result["failed_wake"] = None
    except GroupFailed as exc:
        result["failed_wake"] = {"ranks": sorted(exc.ranks), "why": exc.ranks.get(1, ""), "message": str(exc)}
    result["after_failed_wake"] = ctl.state.value
    result["host_after_failed_wake"] = {t: u.host for t, u in ctl.projection.residency.items()}
    result["resident_after_failed_wake"] = {t: u.resident for t, u in allocator.usage().items()}
    say("failed wake rolled back")

    if filler is not None:
        del filler
        torch.cuda.empty_cache()
    ctl.wake()
    result["after_wake"] = ctl.state.value
    result["weights"] = [float(weights.min()), float(weights.max())]
    kv.fill_(1.0)
    result["after_group_wake"] = replay()  # the same weights: 6 again
    weights.fill_(float(rank + 2))
    result["after_update"] = replay()  # 2 * (2 + 3) = 10
    result["awake"] = ctl.wait_for(State.AWAKE, timeout=1)
    group = ctl.group
    result["last_round"] = group.last.round if group is not None and group.last is not None else None
    dist.barrier(device_ids=[rank])
    graph.reset()  # a live graph holding an NCCL collective makes destroy_process_group wait for ever
    torch.cuda.synchronize()
    dist.destroy_process_group()
    say("done")


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    faulthandler.dump_traceback_later(WORKER_TIMEOUT - 30, exit=True)
    try:
        _worker(args.rank, args.port, args.logdir, result)
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        Path(args.out).write_text(json.dumps(result))
    return 0


@pytest.mark.gpu2
def test_full_gpu_on_rank1_rolls_the_group_back_then_it_wakes_and_replays(tmp_path: Path) -> None:
    """Rank 1's wake fails (GPU full): both ranks raise GroupFailed and stay asleep intact; after freeing, the group wakes and the all-reduce graph replays right."""
    env = {k: v for k, v in os.environ.items() if k != "NCCL_GRAPH_REGISTER"}
    env.update(NO_MULTICAST)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    port = support.free_port()
    procs = []
    for rank in range(WORLD):
        cmd = [sys.executable, __file__, "--rank", str(rank), "--port", str(port), "--logdir", str(tmp_path / "logs")]
        cmd += ["--out", str(tmp_path / f"rank{rank}.json")]
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
    outputs = "\n".join(f"--- rank {r}:\n" + (tmp_path / f"rank{r}.log").read_text()[-6000:] for r in range(WORLD))
    missing = [r for r in range(WORLD) if not (tmp_path / f"rank{r}.json").exists()]
    if missing:
        pytest.fail(f"workers {missing} wrote no result:\n{outputs}")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(json.dumps(results, indent=1))
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        pytest.fail(f"workers failed ({'; '.join(errors)}):\n{outputs}")
    for rank, r in enumerate(results):
        assert r["before"] == [6.0, 6.0]
        assert r["asleep"] == "asleep_l1"
        assert r["failed_wake"] is not None, f"rank {rank}: the wake did not fail"
        assert r["failed_wake"]["ranks"] == [1]
        assert "memory" in r["failed_wake"]["why"].lower()
        assert r["after_failed_wake"] == "asleep_l1"
        assert r["host_after_failed_wake"] == r["host_asleep"]  # every backup survived the rollback
        assert r["host_asleep"]["weights"] >= 4 * N
        assert r["host_asleep"]["cudagraph"] > 0
        assert r["resident_after_failed_wake"]["weights"] == 0  # and nothing stayed mapped
        assert r["after_wake"] == "awake"
        assert r["weights"] == [float(rank + 1)] * 2
        assert r["after_group_wake"] == [6.0, 6.0]
        assert r["after_update"] == [10.0, 10.0]
        assert r["awake"]
    assert results[0]["last_round"] == results[1]["last_round"]
    from torpor.hooks import fleet

    view = fleet(tmp_path / "logs").engine("tp2")
    assert view.state == "awake"
    assert view.group is not None
    assert view.group.consistent
    assert codes == [0] * WORLD, outputs


if __name__ == "__main__":
    sys.exit(_main())
