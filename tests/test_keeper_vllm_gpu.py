"""GPU, vLLM: an engine asleep with --load-format torpor-keeper is killed -9; its restart serves the kept weights.

Two tests: ``vllm.LLM`` with an in-place weight update (every parameter's and buffer's checksum decides), and
``vllm serve`` over HTTP (the restart's first completion must be the dead server's, and the keeper must
record the adoption). In the first, every parameter's and buffer's checksum decides (docs/vllm.md, "Exactness": greedy tokens of a random-weight model
flip between generations of one engine); the tokens are compared and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import vllm_gpu_support as support
from keeper_process import running_keeper, start_keeper
from keeper_vllm_engine import MARK
from support import WITHOUT_TORCH
from test_vllm_serve_gpu import serve

from torpor.keeper import KeeperLink

pytestmark = pytest.mark.timeout(900)
HERE = Path(__file__).resolve().parent


def _run(mode: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HERE / "keeper_vllm_engine.py"), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=HERE,
        env=env,
        start_new_session=True,  # its own process group: kill -9 reaches the engine core and the workers too
    )


def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The engine's result line, past vLLM's own log lines on the same stdout."""
    for out in proc.stdout or ():
        if out.startswith(MARK):
            result: dict[str, Any] = json.loads(out[len(MARK) :])
            return result
    raise AssertionError(f"the engine exited with {proc.wait()} before it printed its result")


def _kill(proc: subprocess.Popen[Any] | None) -> None:
    """Kill ``proc``'s whole process group (engine core and workers), whatever of it still runs."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.gpu
def test_a_killed_vllm_engine_restarts_with_the_kept_weights(tmp_path: Path) -> None:
    """Asleep at level 1 after an in-place update, kill -9 of every process, restart: every tensor is the updated one."""
    model = support.require_vllm_gpu()
    sock = tmp_path / "k" / "keeper.sock"
    keeper = start_keeper(sock, budget="32G")
    env = {
        **os.environ,
        support.ENV_MODEL: str(model),
        "TORPOR_KEEPER_SOCKET": str(sock),
        "TORPOR_KEEPER_ENGINE": "vllm-keeper-test",
        "TORPOR_LOG_DIR": str(tmp_path / "logs"),
        "TORPOR_ENGINE": "vllm-keeper-test",
        "VLLM_PLUGINS": "torpor",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # the weight update is a function sent to the worker
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    first = again = None
    try:
        first = _run("first", env)
        asleep = _line(first)
        changed = [n for n, v in asleep["updated_sums"].items() if asleep["loaded_sums"][n] != v]
        assert len(changed) == 1 and changed[0].endswith("norm.weight"), changed  # the update: one tensor changed
        with KeeperLink(sock) as link:
            backups = link.status()["backups"]
        assert [b["engine"] for b in backups] == ["vllm-keeper-test-rank0"], backups
        _kill(first)
        again = _run("again", env)
        restarted = _line(again)
        again.communicate(timeout=300)  # reads the rest of its output as it shuts down
        differ = [n for n, v in asleep["updated_sums"].items() if restarted["sums"].get(n) != v]
        assert not differ, f"the restart's tensors are not the kept (updated) ones: {differ[:5]}"
        same = sum(a == b for a, b in zip(restarted["tokens"], asleep["updated"], strict=True))
        print(f"restart's tokens equal the updated engine's for {same} of {len(asleep['updated'])} prompts")
        with KeeperLink(sock) as link:
            adoptions = link.status()["adoptions"]
        assert adoptions and adoptions[-1]["engine"] == "vllm-keeper-test-rank0", adoptions
    finally:  # no engine outlives the test, holding the GPU for the next one
        _kill(first)
        _kill(again)
        keeper.kill()
        keeper.wait()


@pytest.mark.gpu
def test_vllm_serve_killed_asleep_restarts_with_its_weights_from_the_keeper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vllm serve asleep at level 1 is killed with -9; restarted, it adopts the kept backup and completes the same."""
    sock = tmp_path / "k" / "keeper.sock"
    monkeypatch.setenv("TORPOR_KEEPER_SOCKET", str(sock))
    monkeypatch.setenv("TORPOR_KEEPER_ENGINE", "keeper-serve")
    prompt = "The capital of France is"
    with running_keeper(sock, budget="8G"):
        (tmp_path / "first").mkdir()
        with serve(tmp_path / "first", "keeper-serve-1", "--load-format", "torpor-keeper") as server:
            before = server.complete(prompt)
            assert before["http"] == 200, before
            assert server.ok("POST", "/sleep?level=1") == {"status": "sleeping", "level": 1}
            kept = _published(sock, "keeper-serve-rank0")
            assert server.proc is not None
            _kill(server.proc)  # the server, its engine core and its workers
        (tmp_path / "second").mkdir()
        with serve(tmp_path / "second", "keeper-serve-2", "--load-format", "torpor-keeper") as again:
            after = again.complete(prompt)
            assert again.log_path is not None
            log = again.log_path.read_text(errors="replace")
        state = KeeperLink(sock).status()
    adoptions = [a for a in state["adoptions"] if a["backup"] == kept["backup"]]
    assert adoptions, f"the restart adopted nothing; keeper: {state}"
    assert adoptions[0]["from_pid"] == kept["pid"] and adoptions[0]["bytes"] == kept["bytes"], adoptions
    assert "nothing adopted" not in log, "the restart fell back to the checkpoint"
    print(f"adopted {kept['bytes']} bytes from dead pid {kept['pid']} in {adoptions[0]['seconds']:.3f} s")
    assert after == before


def _published(sock: Path, engine: str, timeout: float = 60) -> dict[str, Any]:
    """The keeper's record of ``engine``'s published backup, once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        backups = [b for b in KeeperLink(sock).status()["backups"] if b["engine"] == engine]
        if backups:
            found: dict[str, Any] = backups[0]
            return found
        time.sleep(0.2)
    raise AssertionError(f"no backup of {engine} published within {timeout} s of the sleep")


def test_without_torch_the_gpu_tests_are_skipped_not_errors() -> None:
    """Where torch is missing, this file's GPU tests are collected and skipped with the reason, as every GPU test is."""
    argv = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-rs", "-m", "gpu", str(Path(__file__))]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *argv],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "2 skipped" in done.stdout and "needs a CUDA GPU" in done.stdout, done.stdout[-3000:]
