"""torpor.bench.vllm and vllm_engine off the GPU: the engine order, the summary and table, torpor's per-tag phases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import RigMaker

from torpor.bench import vllm as vllm_bench
from torpor.bench import vllm_engine
from torpor.bench.vllm_engine import torpor_phases


def _run(backend: str, first: float, later: float, *, ok: bool = True) -> dict[str, Any]:
    """One engine's result as vllm_engine writes it: four level-1 cycles, then two level-2 cycles."""
    cycles = []
    for i in range(4):
        sleep = first if i == 0 else later
        worker = [["worker.sleep", sleep * 0.8], ["backend.suspend", sleep * 0.5], ["worker.wake_up", 0.01]]
        cycles.append({"level": 1, "sleep_s": sleep, "wake_s": 0.05, "freed": 42e9, "same": True, "worker": worker})
    for _ in range(2):
        cycles.append({"level": 2, "sleep_s": 0.06, "wake_s": 0.2, "reload_s": 0.1, "freed": 42.3e9, "worker": []})
    phases = [
        {
            "op": "sleep",
            "level": 1,
            "seconds": s,
            "tags": {"weights": {"bytes": 400e6, "backup": s / 4, "release": 0.001}},
        }
        for s in (first, later, later, later)
    ]
    return {"backend": backend, "ok": ok, "identical": ok, "start_s": 20.0, "cycles": cycles, "torpor_phases": phases}


def test_order_alternates_so_each_backend_goes_first_and_last_equally() -> None:
    """Two rounds are cumem, torpor, torpor, cumem; three add cumem, torpor; the first backend can be chosen."""
    assert vllm_bench.order(2) == ["cumem", "torpor", "torpor", "cumem"]
    assert vllm_bench.order(3) == ["cumem", "torpor", "torpor", "cumem", "cumem", "torpor"]
    assert vllm_bench.order(1, first="torpor") == ["torpor", "cumem"]


def test_summary_separates_first_and_later_cycles_and_the_parts_of_a_later_sleep() -> None:
    """First sleep is each engine's first cycle, later the median of the rest; parts come from the worker's timers."""
    runs = [_run("cumem", 0.3, 0.07), _run("torpor", 0.12, 0.04), _run("torpor", 0.14, 0.05), _run("cumem", 0.35, 0.06)]
    s = vllm_bench.summarize(runs)
    assert s["cumem"]["l1_sleep_first_s"] == pytest.approx(0.325)
    assert s["torpor"]["l1_sleep_later_s"] == pytest.approx(0.045)
    assert s["torpor"]["later_sleep_parts_s"]["backend.suspend"] == pytest.approx(0.045 * 0.5)
    assert s["cumem"]["l2_wake_reload_s"] == pytest.approx(0.2)
    assert s["torpor"]["freed_l1_gb"] == pytest.approx(42.0)
    assert s["torpor"]["torpor_later_sleep_tags"]["weights"]["backup"] == pytest.approx(0.045 / 4)
    assert s["cumem"]["torpor_later_sleep_tags"] == {}
    assert s["cumem"]["ok"] and s["torpor"]["identical"]


def test_summary_marks_a_backend_whose_engine_failed() -> None:
    """An engine that failed (no cycles, or outputs that changed) makes its backend's row not ok."""
    runs = [
        _run("cumem", 0.3, 0.07),
        {"backend": "torpor", "ok": False, "error": "boom"},
        _run("torpor", 0.1, 0.04, ok=False),
    ]
    s = vllm_bench.summarize(runs)
    assert not s["torpor"]["ok"] and not s["torpor"]["identical"]
    assert s["torpor"]["engines"] == 1
    table = vllm_bench.markdown(
        {"model": "/m/tiny", "mode": "compile", "order": ["cumem", "torpor"], "cycles": 4, "l2_cycles": 2, "summary": s}
    )
    assert "DIFFERENT or failed" in table
    assert "| `cumem` | 0.300 s / 0.070 s |" in table


def test_spread_gives_each_rows_single_cycles_and_calls_overlapping_ranges_a_tie() -> None:
    """Each row's min-max per backend; ranges apart name the faster backend, overlapping ones are a tie."""
    runs = [_run("cumem", 0.3, 0.07), _run("torpor", 0.12, 0.04), _run("torpor", 0.14, 0.08), _run("cumem", 0.35, 0.06)]
    s = vllm_bench.summarize(runs)
    assert s["torpor"]["ranges"]["l1_sleep_later_s"] == [0.04, 0.08]
    assert s["cumem"]["ranges"]["l1_sleep_first_s"] == [0.3, 0.35]
    table = "\n".join(vllm_bench.spread(s))
    assert "| L1 sleep, first | 0.300-0.350 s | 0.120-0.140 s | `torpor` faster |" in table
    assert "| L1 sleep, later | 0.060-0.070 s | 0.040-0.080 s | overlap: not told apart |" in table
    assert vllm_bench.verdict([0.01, 0.02], [0.03, 0.04]) == "`cumem` faster"
    assert vllm_bench.verdict(None, [0.03, 0.04]) == "n/a"
    data = {"model": "/m", "mode": "compile", "order": ["cumem", "torpor"], "cycles": 4, "l2_cycles": 2}
    assert "Single cycles, min-max" in vllm_bench.markdown({**data, "runs": runs, "summary": s})


def test_table_shows_torpor_tags_and_one_profile_per_backend() -> None:
    """The per-tag rows come from torpor's log; each backend's first profiled engine gives the profile table."""
    profile = {
        "sleep": {"seconds": 0.09, "top": [{"func": "cumem.py:233:sleep", "calls": 1, "tottime": 0.04, "cum": 0.05}]}
    }
    runs = [
        {**_run("cumem", 0.3, 0.07), "engine": 0, "profile": profile},
        {**_run("torpor", 0.12, 0.04), "engine": 1},
        {**_run("cumem", 0.3, 0.07), "engine": 2, "profile": profile},
    ]
    data = {"model": "/m", "mode": "graphs", "order": ["cumem", "torpor", "cumem"], "cycles": 4, "l2_cycles": 2}
    table = vllm_bench.markdown({**data, "runs": runs, "summary": vllm_bench.summarize(runs)})
    assert "| weights | 400 MB | 0.010 s | 0.001 s |" in table
    assert table.count("cumem.py:233:sleep") == 1
    assert "| `torpor` | 0.040 s | 0.032 s | 0.020 s | 0.040 s |" in table


def test_torpor_phases_reads_sleeps_and_wakes_with_per_tag_seconds(tmp_path: Path, make_rig: RigMaker) -> None:
    """A controller's log on the simulated device gives one phase per sleep and wake, with each tag's steps."""
    from torpor.statemachine.machine.controller import SleepController

    MiB = 1 << 20
    memory = make_rig("cuda_like", capacity=64 * MiB).allocator
    controller = SleepController(memory, log=tmp_path / "bench0.rank0.jsonl", engine="bench0", rank=0)
    memory.allocate(4 * MiB, "weights")
    memory.allocate(8 * MiB, "kv_cache")
    controller.observe()
    for _ in range(2):
        controller.sleep(1)
        controller.wake()
    controller.sleep(2)
    controller.wake(["weights"])
    phases = torpor_phases(tmp_path)
    assert [(p["op"], p.get("level")) for p in phases] == [("sleep", 1), ("wake", None)] * 2 + [
        ("sleep", 2),
        ("wake", None),
    ]
    first = phases[0]["tags"]
    assert "backup" in first["weights"] and "release" in first["weights"]
    assert first["kv_cache"]["bytes"] == 8 * MiB and "backup" not in first["kv_cache"]
    assert "restore" in phases[1]["tags"]["weights"]
    assert list(phases[-1]["wake_tags"]) == ["weights"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it holds no memory, and init may be slow to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_run_engine_ends_the_processes_an_engine_left_behind_before_the_next_starts(tmp_path: Path) -> None:
    """An engine that exits at once and leaves a child running (vLLM's engine core): the child is ended, and counted."""
    child = "import time; time.sleep(300)"
    engine = (
        "import os, subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); print(p.pid, flush=True); os._exit(3)"
    )
    log = tmp_path / "engine.log"
    rc, left = vllm_bench.run_engine([sys.executable, "-c", engine], dict(os.environ), log, timeout=60)
    pid = int(log.read_text().split()[0])
    assert rc == 3 and left == [pid]
    assert not _alive(pid)


def test_run_engine_past_its_timeout_is_ended_with_everything_it_started(tmp_path: Path) -> None:
    """An engine that hangs is reported as a timeout, and neither it nor its child survives the call."""
    engine = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"
    rc, left = vllm_bench.run_engine([sys.executable, "-c", engine], dict(os.environ), tmp_path / "e.log", timeout=2)
    assert rc == "timeout" and len(left) == 1
    assert not [p for p in left if _alive(p)]


def test_end_group_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    """A process that ignores SIGTERM is killed after the grace period; a group with nobody alive is left alone."""
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert vllm_bench.end_group(proc.pid, grace=0.3, kill_wait=10) == [proc.pid]
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert vllm_bench.end_group(proc.pid) == []


def test_run_asks_every_engine_for_the_checksums_of_its_tensors_and_a_warm_up_generation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each engine of `torpor bench --vllm` checksums every parameter and buffer after each wake and takes its baseline after a warm-up generation."""
    commands: list[list[str]] = []

    def fake_engine(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> tuple[int, list[int]]:
        commands.append(cmd)
        return 1, []

    monkeypatch.setattr(vllm_bench, "run_engine", fake_engine)
    vllm_bench.run("/m/tiny", rounds=1, cycles=2, l2_cycles=1, out=tmp_path, floor=lambda: (50e9, 40e9))
    assert len(commands) == 2
    for cmd in commands:
        assert "--checksums" in cmd
        assert cmd[cmd.index("--warmups") + 1] == "1"


def test_tensors_unchecked_are_not_called_identical() -> None:
    """An engine whose cycles carry no checksums reports its tensors as not checked, and the table says so, not identical."""
    verdict = vllm_engine.tensor_verdict([{"level": 1, "same": True}, {"level": 2, "same": True}])
    assert verdict is None
    assert vllm_engine.tensor_verdict([{"tensors_changed": [], "tensors_checked": 3}]) is True
    assert vllm_engine.tensor_verdict([{"tensors_changed": []}, {"tensors_changed": ["w"]}]) is False
    unchecked = {**_run("torpor", 0.1, 0.04), "tensors_identical": None}
    checked = {**_run("cumem", 0.3, 0.07), "tensors_identical": True}
    s = vllm_bench.summarize([checked, unchecked])
    assert s["cumem"]["tensors_identical"] is True
    assert s["torpor"]["tensors_identical"] is None
    table = vllm_bench.markdown(
        {"model": "/m/tiny", "mode": "compile", "order": ["cumem", "torpor"], "cycles": 4, "l2_cycles": 2, "summary": s}
    )
    cumem_row = next(line for line in table.splitlines() if line.startswith("| `cumem` | 0.300 s"))
    torpor_row = next(line for line in table.splitlines() if line.startswith("| `torpor` | 0.100 s"))
    assert "| identical | identical |" in cumem_row
    assert "| not checked |" in torpor_row


def test_every_row_is_set_against_the_floor_measured_in_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench --vllm` measures the pinned host-link floor once per run and gives each row of each backend (L1 and L2) as a multiple of it."""
    floors: list[int] = []

    def fake_engine(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> tuple[int, list[int]]:
        backend = cmd[cmd.index("--backend") + 1]
        result = {**_run(backend, 0.3, 0.2), "model_bytes": {"parameters": 8_000_000_000, "buffers": 500_000_000}}
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(result))
        return 0, []

    def floor() -> tuple[float, float]:
        floors.append(1)
        return 50e9, 40e9  # bytes/s to host, back

    monkeypatch.setattr(vllm_bench, "run_engine", fake_engine)
    data = vllm_bench.run("/m/tiny", rounds=2, out=tmp_path, floor=floor)
    assert floors == [1] and data["floor_d2h_Bps"] == 50e9 and data["floor_h2d_Bps"] == 40e9
    rows = data["floor"]
    for backend in ("cumem", "torpor"):
        assert rows[backend]["l1_sleep_first_s"] == pytest.approx({"floor_s": 8.5e9 / 50e9, "x": 0.3 / (8.5e9 / 50e9)})
        assert rows[backend]["l1_sleep_later_s"]["x"] == pytest.approx(0.2 / 0.17)
        assert rows[backend]["l1_wake_later_s"] == pytest.approx({"floor_s": 8.5e9 / 40e9, "x": 0.05 / (8.5e9 / 40e9)})
        assert rows[backend]["l2_sleep_s"]["floor_s"] == pytest.approx(
            0.5e9 / 50e9
        )  # a level-2 sleep saves the buffers
        assert rows[backend]["l2_wake_reload_s"]["x"] == pytest.approx(0.2 / (8.5e9 / 40e9))
    table = (tmp_path / "vllm-bench.md").read_text()
    assert "pinned host-link floor measured in this run: 50.0 GB/s to host, 40.0 GB/s back" in table
    assert "| L1 sleep, first | 0.170 s | 1.76x | 1.76x |" in table


def test_the_floor_is_measure_floor_run_in_a_child_on_the_same_gpu(tmp_path: Path) -> None:
    """The vLLM bench's floor is torpor.bench.device.measure_floor (the synthetic bench's), run in a child process: the driver keeps no CUDA context or pinned cache while the engines run."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path / 'ran')!r}).write_text('measure_floor')\n"
        "uint8 = 'uint8'\n"
        "class _T:\n    def copy_(self, src, non_blocking=False): pass\n"
        "def empty(*args, **kwargs): return _T()\n"
        "class cuda:\n    synchronize = staticmethod(lambda: None)\n    empty_cache = staticmethod(lambda: None)\n"
    )
    d2h, h2d = vllm_bench.floor_in_child(
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    )
    assert d2h > 0 and h2d > 0 and (tmp_path / "ran").read_text() == "measure_floor"
    assert "torch" not in sys.modules or not hasattr(sys.modules["torch"], "_T")
