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


# -- the reliability matrix (a child process): store faults, uneven commands, a reopened controller, skew ----------


class FaultyStore:
    """A c10d store whose calls can fail from the ``at``-th call on (once, or every call until disarmed)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: list[str] = []
        self._at: int | None = None
        self._persistent = False

    def arm(self, at: int | None, persistent: bool = False) -> None:
        self.calls, self._at, self._persistent = [], at, persistent

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def call(*args: Any) -> Any:
            index = len(self.calls)
            self.calls.append(name)
            at = self._at
            if at is not None and (index == at or (self._persistent and index > at)):
                if not self._persistent:
                    self._at = None
                msg = f"injected: store call #{index} ({name}) lost its connection"
                raise RuntimeError(msg)
            return method(*args)

        return call


#: The group timeout of the reliability matrix; the clock-skew scenario uses SKEW_TIMEOUT.
REL_TIMEOUT = 1.0
SKEW_TIMEOUT, SKEW = 3.0, 10.0


def _reliability(rank: int, world: int, store_port: int, out: dict[str, Any], path: Path) -> None:
    import torch.distributed as dist

    from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
    from torpor.errors import GroupFailed
    from torpor.statemachine import SleepController
    from torpor.torchgroup import TorchGroup

    raw = dist.TCPStore("127.0.0.1", store_port, world, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", raw), rank=rank, world_size=world)
    store = FaultyStore(raw)  # the long-lived store: the parent hosts it and left an earlier run's keys in it
    driver = SimDriver(capacity=16 * MiB, granularity=16 * KiB)
    alloc = TaggedAllocator(driver=driver, host=HostPolicy(prepin=False, chunk_bytes=128 * KiB, threads=1))
    rng = random.Random(rank)
    blocks = {tag: alloc.allocate(size, tag) for tag, size in TAGS.items()}
    for tag, addr in blocks.items():
        driver.write(addr, rng.randbytes(TAGS[tag]))
    original = {t: driver.read(blocks[t], TAGS[t]) for t in ("weights", "cudagraph")}

    def controller(timeout: float = REL_TIMEOUT) -> SleepController:
        group = TorchGroup(dist.group.WORLD, store=store, name="tp")
        return SleepController(alloc, engine="tp", rank=rank, fsync=False, group=group, group_timeout=timeout)

    ctl = controller()
    scenarios: list[dict[str, Any]] = []
    out["scenarios"] = scenarios

    def observe() -> tuple[str, bool]:
        """This rank's state, and whether its memory is what that state says (bytes, residency)."""
        usage, residency = alloc.usage(), ctl.projection.residency
        ok = all((usage[t].resident, usage[t].host) == (residency[t].resident, residency[t].host) for t in TAGS)
        if ctl.state.value == "awake":
            ok = ok and all(driver.read(blocks[t], TAGS[t]) == original[t] for t in original)
        elif ctl.state.value == "asleep_l1":
            ok = ok and all(residency[t].host == TAGS[t] for t in original)
        return ctl.state.value, ok

    def scenario(name: str, action: Any) -> None:
        """Run ``action`` on this rank, then (every rank together) the next joint sleep and wake."""
        seen: dict[str, Any] = {"name": name, "raised": None}
        start = time.monotonic()
        try:
            action()
        except GroupFailed as exc:
            seen.update(raised="GroupFailed", ranks=sorted(exc.ranks))
        except Exception as exc:
            seen["raised"] = f"{type(exc).__name__}: {exc}"
        seen["seconds"] = time.monotonic() - start
        store.arm(None)
        seen["after"], seen["memory"] = observe()
        dist.barrier()
        seen["next"] = []
        commands = ["wake", "sleep", "wake"] if ctl.state.value != "awake" else ["sleep", "wake"]
        for command in commands:
            begin = time.monotonic()
            try:
                ctl.sleep(1) if command == "sleep" else ctl.wake()
                ok = "ok"
            except Exception as exc:
                ok = f"{type(exc).__name__}: {exc}"
            seen["next"].append([command, ok, time.monotonic() - begin])
        seen["final"], seen["final_memory"] = observe()
        scenarios.append(seen)
        path.write_text(json.dumps(out))
        dist.barrier()

    def joint(command: str) -> None:
        ctl.sleep(1) if command == "sleep" else ctl.wake()

    # an earlier run left its keys in the store (the parent put them there): the first commands just work
    scenario("stale store", lambda: None)
    # a clean round, to learn how many store calls each rank makes in one
    scenario("clean", lambda: joint("sleep"))
    store.arm(None)
    joint("sleep")
    calls = list(store.calls)
    joint("wake")
    every: list[Any] = [None] * world
    dist.all_gather_object(every, calls)
    out["calls"] = every
    for faulty in sorted({0, world - 1}):
        steps = len(every[faulty])
        voted = every[faulty].index("set") if "set" in every[faulty] else steps
        for at in range(steps):
            for persistent in (False, True):
                if persistent and faulty != 0 and at > voted:
                    continue  # a rank cut off after its vote landed cannot learn the outcome: see docs/groups.md
                command = ("sleep", "wake")[at % 2]
                if command == "wake":
                    joint("sleep")

                def armed(
                    command: str = command, at: int = at, persistent: bool = persistent, faulty: int = faulty
                ) -> None:
                    if rank == faulty:
                        store.arm(at, persistent)
                    joint(command)

                kind = "every call from" if persistent else "one call"
                scenario(f"{command}: rank {faulty}'s store fails at {kind} #{at} ({every[faulty][at]})", armed)
    for alone in sorted({0, world - 1}):
        scenario(f"uneven: rank {alone} alone calls wake", lambda alone=alone: ctl.wake() if rank == alone else None)

    def reopen() -> None:
        nonlocal ctl
        if rank == 1:
            ctl.close()
            ctl = controller()

    scenario("rank 1 reopens its controller", reopen)
    skewed = time.time
    if rank == 1:
        time.time = lambda: skewed() - SKEW  # type: ignore[assignment]
    ctl.group.timeout = SKEW_TIMEOUT  # type: ignore[union-attr]
    scenario(f"rank 1's clock {SKEW:g} s behind, timeout {SKEW_TIMEOUT:g} s", lambda: joint("sleep"))
    time.time = skewed  # type: ignore[assignment]
    out["done"] = True


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--logdir", required=True)
    parser.add_argument("--lose", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--store-port", type=int, default=0)
    args = parser.parse_args()
    result: dict[str, Any] = {"rank": args.rank}
    try:
        if args.store_port:
            _reliability(args.rank, args.world, args.store_port, result, Path(args.out))
        else:
            _worker(args.rank, args.world, args.port, args.logdir, args.lose, result, Path(args.out))
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(args.out).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # a group that lost a rank cannot be torn down cleanly: leave without destroy_process_group


# -- the tests (the parent) ------------------------------------------------------------------


def _spawn(tmp_path: Path, world: int, lose: str, store_port: int = 0) -> list[dict[str, Any] | None]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    procs = []
    for rank in range(world):
        cmd = [sys.executable, __file__, "--rank", str(rank), "--world", str(world), "--port", str(port)]
        cmd += ["--logdir", str(tmp_path / "logs"), "--lose", lose, "--out", str(tmp_path / f"rank{rank}.json")]
        cmd += ["--store-port", str(store_port)]
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


def _ranks_wrote_results(results: list[dict[str, Any] | None], world: int, tmp_path: Path) -> str:
    """Every rank wrote a result without an error; the ranks' log tails (for the next assertions' messages)."""
    logs = "\n".join(f"--- rank {r}:\n{(tmp_path / f'rank{r}.log').read_text()[-3000:]}" for r in range(world))
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no result\n{logs}"
        assert "error" not in res, f"rank {r}: {res['error']}\n{logs}"
    return logs


def _check_matrix(results: list[dict[str, Any] | None], world: int, tmp_path: Path) -> None:
    logs = _ranks_wrote_results(results, world, tmp_path)
    for r, res in enumerate(results):
        assert res is not None and res.get("matrix_done"), logs
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


def _stale_store(world: int) -> Any:
    """A long-lived store (hosted here, as an agent would) holding an earlier run's keys of group ``tp``.

    The earlier run built its group on one rank only (the build counter is
    off by one), decided 5 rounds, and died in the middle of round 6: opened,
    with an ok vote for a sleep from every rank but rank 0, never decided.
    """
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", free_port(), world, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    from torpor.statemachine.machine.group import Vote

    store.add("torpor/tp/builds", 1)
    store.set("torpor/tp/0/5/list", "[]")
    store.set("torpor/tp/last", "5")
    store.set("torpor/tp/6/open", "an earlier run")
    for r in range(1, world):
        store.set(f"torpor/tp/6/v{r}", Vote(r, 6, "sleep", True).encode())
    return store


def _check_reliability(results: list[dict[str, Any] | None], world: int, tmp_path: Path) -> None:
    logs = _ranks_wrote_results(results, world, tmp_path)
    for r, res in enumerate(results):
        assert res is not None and res.get("done"), f"rank {r} did not finish\n{logs}"
    names = [s["name"] for s in results[0]["scenarios"]]  # type: ignore[index]
    assert len(names) > 10
    for i, name in enumerate(names):
        seen = [res["scenarios"][i] for res in results]  # type: ignore[index]
        where = f"{name}: {seen}"
        assert {s["name"] for s in seen} == {name}, where
        assert len({s["after"] for s in seen}) == 1, where  # every rank in the same state
        assert all(s["memory"] for s in seen), where  # and its memory is what that state says
        assert len({s["raised"] is None for s in seen if s["name"].startswith(("sleep", "wake", "clean"))}) <= 1, where
        for s in seen:
            for _command, ok, seconds in s["next"]:
                assert ok == "ok", where  # the next joint sleep and wake succeed...
                assert seconds < REL_TIMEOUT, where  # ...within the normal time (no timeout waited out)
            assert s["final"] == "awake" and s["final_memory"], where
        if name.startswith(("stale", "clean", "rank 1 reopens", "rank 1's clock")):
            assert all(s["raised"] is None for s in seen), where


def test_two_ranks_survive_store_faults_uneven_commands_reopening_and_skew(tmp_path: Path) -> None:
    """2 gloo ranks: every store call of a round failing (once, or from then on), an uneven command, a reopened controller, a stale store and a skewed clock leave both ranks in one state matching memory; the next sleep and wake succeed."""
    store = _stale_store(2)
    _check_reliability(_spawn(tmp_path, 2, "", store.port), 2, tmp_path)


def test_four_ranks_survive_store_faults_uneven_commands_reopening_and_skew(tmp_path: Path) -> None:
    """4 gloo ranks: the same matrix as with 2 (faults on rank 0 and rank 3); every rank agrees after each and the next sleep and wake succeed."""
    store = _stale_store(4)
    _check_reliability(_spawn(tmp_path, 4, "", store.port), 4, tmp_path)


if __name__ == "__main__":
    sys.exit(_main())
