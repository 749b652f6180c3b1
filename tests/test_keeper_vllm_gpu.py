"""GPU, vLLM: an engine asleep with --load-format torpor-keeper is killed -9; its restart serves the kept weights.

Every parameter's and buffer's checksum decides (docs/vllm.md, "Exactness": greedy tokens of a random-weight model
flip between generations of one engine); the tokens are compared and reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import vllm_gpu_support as support
from keeper_engine import start_keeper
from keeper_vllm_engine import MARK

from torpor.keeper import KeeperLink

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
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


def _kill(proc: subprocess.Popen[str] | None) -> None:
    """Kill ``proc``'s whole process group (engine core and workers), whatever of it still runs."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


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
