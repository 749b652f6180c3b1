"""GPU: a transformers engine asleep at level 1 is killed with -9; a new process adopts its backup, generate() identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from keeper_process import start_keeper

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")
HERE = Path(__file__).resolve().parent


def test_a_killed_transformers_engine_is_adopted_and_generates_the_same(tmp_path: Path) -> None:
    """Level-1 asleep, kill -9, adopt in a fresh process: the greedy tokens are the engine's, the log records it."""
    sock = tmp_path / "k" / "keeper.sock"
    keeper = start_keeper(sock, budget="16G")
    script = str(HERE / "keeper_gpu_engine.py")
    try:
        eng = subprocess.Popen(
            [sys.executable, script, "engine", str(sock), "qwen"], stdout=subprocess.PIPE, text=True, cwd=HERE.parent
        )
        line = eng.stdout.readline() if eng.stdout else ""
        assert line, "the engine exited before it slept"
        asleep = json.loads(line)
        assert asleep["backup"] and asleep["fallbacks"] == 0, asleep
        os.kill(eng.pid, signal.SIGKILL)
        eng.wait()
        log = tmp_path / "adopter.log"
        done = subprocess.run(
            [sys.executable, script, "adopt", str(sock), "qwen", str(log)],
            capture_output=True,
            text=True,
            cwd=HERE.parent,
            timeout=600,
            check=True,
        )
        adopted = json.loads(done.stdout.strip().splitlines()[-1])
        print(adopted["adopted"], f"adopt() {adopted['seconds']:.3f} s")
        assert adopted["before"] != asleep["tokens"], "the fresh model already generated the engine's tokens"
        assert adopted["tokens"] == asleep["tokens"]
        assert f"from dead pid {eng.pid}" in adopted["adopted"]
        assert adopted["prefetched"] and adopted["released"], adopted
        kinds = [json.loads(x).get("kind") for x in log.read_text().splitlines() if x.strip()]
        assert "backup_adopted" in kinds
    finally:
        keeper.kill()
        keeper.wait()
