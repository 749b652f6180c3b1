"""Groups over real gloo process groups (2 and 4 processes) on the simulated device: all or nothing, retries, dead ranks.

Each test starts the ranks as processes (this file run as a script). Every
rank drives a real ``TaggedAllocator`` on a ``SimDriver`` through a
``SleepController`` whose group is the gloo world group, runs the whole
matrix (each rank in turn failing at sleep, wake and discard, each failure
followed by a retry) and writes what it saw; the parent checks that every
rank raised ``GroupFailed`` naming the failing rank, rolled back with every
byte intact, and that the retry succeeded. The last scenarios of a run lose
a rank: killed (SIGKILL) mid-wake, or hung mid-sleep past the group timeout.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from support import free_port

ROOT = Path(__file__).resolve().parent.parent
KiB, MiB = 1 << 10, 1 << 20
TAGS = {"weights": 192 * KiB, "kv_cache": 256 * KiB, "cudagraph": 128 * KiB}
#: The driver call each command's injected failure hits on the failing rank (all inside the command's prepare).
FAULTS = {"sleep": ("copy_d2h", False), "wake": ("create", True), "discard": ("unmap", False)}
RUN_TIMEOUT = 120  # seconds for the whole run; a healthy one takes a few
LOSE_TIMEOUT = 1.5  # the group timeout in the lost-rank scenarios
HANG = LOSE_TIMEOUT * 2.5  # how long the hung rank hangs


# -- the worker (a child process) ---------------------------------------------------------


def _worker(rank: int, world: int, port: int, logdir: str, lose: str, out: dict[str, Any], path: Path) -> None:
    import torch.distributed as dist

    from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
    from torpor.errors import GroupFailed
    from torpor.statemachine import SleepController

    class Driver(SimDriver):
        """SimDriver that can also kill or stall this process at a call (a rank dying or hanging mid-command)."""

        stall: tuple[str, str] | None = None

        def invoke(self, call: str, *args: Any) -> Any:
            if self.stall is not None and self.stall[0] == call:
                if self.stall[1] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                self.stall = None
                time.sleep(HANG)
            return super().invoke(call, *args)

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    driver = Driver(capacity=16 * MiB, granularity=16 * KiB)
    alloc = TaggedAllocator(driver=driver, host=HostPolicy(prepin=False, chunk_bytes=128 * KiB, threads=1))
    rng = random.Random(rank)
    blocks = {tag: alloc.allocate(size, tag) for tag, size in TAGS.items()}
    for tag, addr in blocks.items():
        driver.write(addr, rng.randbytes(TAGS[tag]))

    def digest(tags: tuple[str, ...] = ("weights", "cudagraph")) -> dict[str, str]:
        return {t: hashlib.sha256(driver.read(blocks[t], TAGS[t])).hexdigest() for t in tags}

    original = digest()
    ctl = SleepController(alloc, log=logdir + "/", engine="tp", rank=rank, fsync=False, group=dist.group.WORLD)
    ctl.group.timeout = 20.0  # type: ignore[union-attr]
    scenarios: list[dict[str, Any]] = []
    out["scenarios"] = scenarios

    def attempt(command: str, failing: int) -> dict[str, Any]:
        """One collective command with ``failing``'s fault armed; what this rank saw."""
        call, oom = FAULTS[command]
        if rank == failing:
            driver.fail(call, oom=oom, reason=f"injected on rank {rank}")
        seen: dict[str, Any] = {"command": command, "failing": failing, "before": ctl.state.value}
        try:
            run(command)
            seen["raised"] = None
        except GroupFailed as exc:
            seen.update(raised="GroupFailed", ranks=sorted(exc.ranks), why=exc.ranks.get(failing, ""))
        except Exception as exc:
            seen["raised"] = f"{type(exc).__name__}: {exc}"
        driver.clear_faults()
        seen["after"] = ctl.state.value
        seen["host"] = {t: u.host for t, u in ctl.projection.residency.items()}
        seen["intact"] = ctl.state.value not in ("awake",) or digest() == original
        run(command)  # the retry, on every rank
        seen["retry"] = ctl.state.value
        if ctl.state.value != "asleep_l1":
            seen["retry_intact"] = digest() == original
        return seen

    def run(command: str) -> None:
        if command == "sleep":
            ctl.sleep(1)
        elif command == "wake":
            ctl.wake()
        else:
            ctl.discard(["kv_cache"])

    for failing in range(world):
        scenarios.append(attempt("sleep", failing))  # awake -> (rolled back) -> asleep_l1
        scenarios.append(attempt("wake", failing))  # asleep_l1 -> (rolled back) -> awake
        scenarios.append(attempt("discard", failing))  # awake -> (rolled back) -> partially_awake
        ctl.wake(["kv_cache"])  # back to awake for the next rank
    out["matrix_done"] = True
    path.write_text(json.dumps(out))  # this rank may be the one lost next

    # -- losing ranks, one after the other --
    losses: list[dict[str, Any]] = []
    out["losses"] = losses
    for loss in lose.split(","):
        how, lost = loss.split(":")[0], int(loss.split(":")[1])
        if how == "hang":
            command, call = "sleep", "copy_d2h"
        else:
            command, call = (
                "wake",
                "copy_h2d",
            )  # mid-wake, after mapping (map runs in the native library, not in invoke)
            ctl.sleep(1)
        path.write_text(json.dumps(out))  # this rank may be the one lost next
        dist.barrier()  # start together: only the lost rank may be late
        ctl.group.timeout = LOSE_TIMEOUT  # type: ignore[union-attr]
        if rank == lost:
            driver.stall = (call, how)
        seen: dict[str, Any] = {"before": ctl.state.value, "timeout": LOSE_TIMEOUT}
        losses.append(seen)
        start = time.monotonic()
        try:
            run(command)
            seen["raised"] = None
        except GroupFailed as exc:
            seen.update(raised="GroupFailed", ranks=sorted(exc.ranks))
        seen["seconds"] = time.monotonic() - start
        seen["after"] = ctl.state.value
        seen["intact"] = ctl.state.value != "awake" or digest() == original
        if how == "hang":
            dist.barrier()  # rank 0 hosts the store: keep it up until the hung rank has read the list
            ctl.group.timeout = 20.0  # type: ignore[union-attr]


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--lose", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result: dict[str, Any] = {"rank": args.rank}
    try:
        _worker(args.rank, args.world, args.port, args.logdir, args.lose, result, Path(args.out))
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # a group that lost a rank cannot be torn down cleanly: leave without destroy_process_group


# -- the tests (the parent) ------------------------------------------------------------------


def _spawn(tmp_path: Path, world: int, lose: str) -> list[dict[str, Any] | None]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    procs = []
    for rank in range(world):
        cmd = [sys.executable, __file__, "--rank", str(rank), "--world", str(world), "--port", str(port)]
        cmd += ["--logdir", str(tmp_path / "logs"), "--lose", lose, "--out", str(tmp_path / f"rank{rank}.json")]
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115  (closed below)
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + RUN_TIMEOUT
    for proc, log in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    results: list[dict[str, Any] | None] = []
    for rank in range(world):
        path = tmp_path / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def _check_matrix(results: list[dict[str, Any] | None], world: int, tmp_path: Path) -> None:
    logs = "\n".join(f"--- rank {r}:\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}" for r in range(world))
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no result\n{logs}"
        assert "error" not in res, f"rank {r}: {res['error']}\n{logs}"
        assert res.get("matrix_done"), logs
        assert len(res["scenarios"]) == 3 * world
        for s in res["scenarios"]:
            where = f"rank {r}, {s['command']} failing on rank {s['failing']}: {s}"
            assert s["raised"] == "GroupFailed", where
            assert s["ranks"] == [s["failing"]], where
            assert s["after"] == s["before"], where  # rolled back on every rank
            assert s["intact"], where
            if r == s["failing"]:
                assert "injected on rank" in s["why"], where
            if s["command"] == "wake":  # back asleep with the backups intact
                assert s["host"]["weights"] == TAGS["weights"], where
                assert s["host"]["cudagraph"] == TAGS["cudagraph"], where
            expected = {"sleep": "asleep_l1", "wake": "awake", "discard": "partially_awake"}[s["command"]]
            assert s["retry"] == expected, where
            assert s.get("retry_intact", True), where


def _group_view(tmp_path: Path) -> Any:
    from torpor.hooks import fleet

    return fleet(tmp_path / "logs").engine("tp")


def test_two_ranks_every_failure_rolls_back_and_a_killed_rank_is_named(tmp_path: Path) -> None:
    """2 gloo ranks: each rank failing sleep, wake or discard rolls both back and names it; retries succeed; a SIGKILLed rank is named within the timeout."""
    results = _spawn(tmp_path, 2, "kill:1")
    _check_matrix(results, 2, tmp_path)
    survivor = results[0]
    assert survivor is not None
    (seen,) = survivor["losses"]
    assert seen["raised"] == "GroupFailed"
    assert seen["ranks"] == [1]
    assert seen["seconds"] < HANG  # raised at the group timeout
    assert seen["after"] == seen["before"] == "asleep_l1"
    view = _group_view(tmp_path)
    assert view.group is not None
    assert not view.group.consistent  # rank 1's log ends mid-wake
    assert view.group.differ == (1,)


def test_four_ranks_every_failure_rolls_back_and_lost_ranks_are_named(tmp_path: Path) -> None:
    """4 gloo ranks: each rank failing each command rolls all back and names it; a rank hung past the timeout, then a killed rank 0 (the store's host), are named and the others stay consistent."""
    results = _spawn(tmp_path, 4, "hang:3,kill:0")
    _check_matrix(results, 4, tmp_path)
    for r, res in enumerate(results):
        assert res is not None
        hang = res["losses"][0]
        assert hang["raised"] == "GroupFailed", res
        assert hang["after"] == hang["before"] == "awake", res
        assert hang["intact"], res
        assert hang["ranks"] == [3], res  # rank 3 too: it came back late and read the list that names it
        if r != 3:
            assert hang["seconds"] < HANG  # raised at the timeout, not when rank 3 came back
        if r != 0:  # rank 0 was killed mid-wake: the others see its store go and name it at once
            kill = res["losses"][1]
            assert kill["raised"] == "GroupFailed", res
            assert kill["ranks"] == [0], res
            assert kill["after"] == kill["before"] == "asleep_l1", res
            assert kill["seconds"] < HANG
    view = _group_view(tmp_path)
    assert view.group is not None
    assert view.group.differ == (0,)  # the survivors agree; rank 0's log ends mid-wake


if __name__ == "__main__":
    sys.exit(_main())
