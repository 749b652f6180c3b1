"""`torpor demo`: every cycle kind on the simulated device, exactness checks that can fail, and the CLI around it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torpor.cli import main
from torpor.demo import CYCLE_KINDS, DemoOptions, pick_device, run_cycle, run_demo
from torpor.demo import run as demo_run
from torpor.demo.cycles import render
from torpor.statemachine import EventKind, SleepController, State, read_events, replay
from torpor.units import MiB


def _torpor() -> list[str]:
    script = Path(sys.executable).with_name("torpor")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torpor.cli"]


def _sim_workload():  # type: ignore[no-untyped-def]
    from torpor.demo.sim import SimWorkload

    return SimWorkload()


@pytest.fixture(scope="module")
def demo_run_output(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    """One in-process run of `torpor demo --cycles 3 --device sim --port 0`, shared by the tests below."""
    log_dir = tmp_path_factory.mktemp("demo")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", "--cycles", "3", "--device", "sim", "--port", "0", "--log-dir", str(log_dir)])
    return rc, buf.getvalue(), log_dir


def test_demo_in_process_is_exact(demo_run_output: tuple[int, str, Path]) -> None:
    """Three sim cycles exit 0, say the device, and report every cycle exact."""
    rc, out, _ = demo_run_output
    assert rc == 0, out
    assert "on device 'sim'" in out
    for i, kind in enumerate(CYCLE_KINDS, 1):
        assert f"cycle {i}/3: {kind.name} -> exact" in out
    assert "every wake was bit-exact" in out
    assert "NOT EXACT" not in out and "DIFFERS" not in out


def test_demo_table_paths_cover_every_state(demo_run_output: tuple[int, str, Path]) -> None:
    """The per-cycle state paths go through asleep_l1, asleep_l2 and partially_awake."""
    _, out, _ = demo_run_output
    paths = [line.split("path", 1)[1] for line in out.splitlines() if line.strip().startswith("path ")]
    assert len(paths) == 3
    assert "asleep_l1" in paths[0] and "partially_awake" not in paths[0]
    assert "asleep_l1 -> resuming -> partially_awake -> resuming -> awake" in paths[1]
    assert "asleep_l2" in paths[2]


def test_demo_table_bytes_match_the_log(demo_run_output: tuple[int, str, Path]) -> None:
    """The bytes each table shows as offloaded and discarded are those of the log's tag_released events."""
    _, out, log_dir = demo_run_output
    events = list(read_events(log_dir / "demo.rank0.jsonl"))
    sleeps = [e for e in events if e.kind is EventKind.SLEEP_COMPLETED]
    assert [int(e.data["level"]) for e in sleeps] == [1, 1, 2]
    totals = [line.split() for line in out.splitlines() if line.strip().startswith("total ")]
    for sleep, row in zip(sleeps, totals, strict=True):
        offloaded = f"{int(sleep.data['offloaded']) / MiB:.2f}"
        discarded = f"{int(sleep.data['discarded']) / MiB:.2f}"
        assert row[3] == offloaded and row[5] == discarded, row
    weights = [e for e in events if e.kind is EventKind.TAG_RELEASED and e.data["tag"] == "weights"]
    assert [e.data["action"] for e in weights] == ["offload", "offload", "discard"]


def test_demo_prints_metrics_url_and_log(demo_run_output: tuple[int, str, Path]) -> None:
    """The output names a loopback metrics URL and the event log, which replays to awake."""
    _, out, log_dir = demo_run_output
    assert re.search(r"metrics +http://127\.0\.0\.1:\d+/metrics", out)
    log = log_dir / "demo.rank0.jsonl"
    assert str(log) in out
    assert f"torpor log show {log}" in out and f"torpor log replay {log}" in out
    proj = replay(log)
    assert proj.state is State.AWAKE and not proj.interrupted and proj.refusals >= 2


def test_demo_writes_dashboard_and_timeline(demo_run_output: tuple[int, str, Path]) -> None:
    """The Grafana dashboard JSON is written and parses; the timeline PNG too when matplotlib is there."""
    _, out, log_dir = demo_run_output
    dash = json.loads((log_dir / "grafana-dashboard.json").read_text())
    assert dash["panels"]
    png = log_dir / "timeline.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "not written" in out
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(png) in out


def test_demo_shows_the_guards(demo_run_output: tuple[int, str, Path]) -> None:
    """The demo shows a capture refused while asleep and the pool release refused while graphs live."""
    _, out, _ = demo_run_output
    assert "guard refused capture while asleep_l1: cannot capture from 'asleep_l1'" in out
    assert "release refused while graphs are alive (6 holder(s), e.g. graph captured at decode batch=1)" in out
    assert re.search(r"graph pool: released \d+\.\d\d MiB", out)


def test_demo_says_what_stays_on_the_device_while_asleep(demo_run_output: tuple[int, str, Path]) -> None:
    """Each cycle says how much device memory stayed in use while asleep, torpor's tags and the untagged rest."""
    _, out, _ = demo_run_output
    stays = re.findall(r"asleep: the device kept (\S+ \S+) in use: torpor tags (\S+ ?\S*), untagged (\S+ \S+)", out)
    assert len(stays) == 3
    assert all(tagged == "0 B" and untagged == "8.00 MiB" for _, tagged, untagged in stays)


def test_demo_subprocess_runs_in_seconds() -> None:
    """`torpor demo --cycles 3 --device sim --port 0` as a program: exit 0, exact, no traceback (timing: docs/bench/demo.md)."""
    proc = subprocess.run(
        [*_torpor(), "demo", "--cycles", "3", "--device", "sim", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "every wake was bit-exact" in proc.stdout
    log = re.search(r"event log +(\S+\.jsonl)", proc.stdout)
    assert log and Path(log.group(1)).exists()


def test_sim_demo_stays_small_in_ram(tmp_path: Path) -> None:
    """The simulated device's bytes (device plus pinned host) stay under 256 MiB through a level-1 cycle."""
    workload = _sim_workload()
    ctrl = SleepController(workload.memory, log=None)
    workload.setup(ctrl)
    peak = workload.driver.used
    result = run_cycle(ctrl, workload, 1, CYCLE_KINDS[0], lambda _: None)
    peak = max(peak, workload.driver.used + workload.driver.host_used)
    assert result.exact
    assert peak < 256 * MiB, peak
    workload.close()


def test_corrupted_restore_is_reported_not_exact() -> None:
    """A byte changed in a weights allocation after wake makes the cycle NOT EXACT, naming weights."""
    workload = _sim_workload()
    ctrl = SleepController(workload.memory, log=None)
    workload.setup(ctrl)
    prepare = workload.prepare

    def corrupting_prepare(woken: list[str], reload_weights: bool) -> None:
        prepare(woken, reload_weights)
        victim = next(a for a in workload.allocs if a.tag == "weights")
        data = bytearray(workload.driver.read(victim.address, 16))
        data[3] ^= 0x01
        workload.driver.write(victim.address, bytes(data))

    workload.prepare = corrupting_prepare  # type: ignore[method-assign]
    result = run_cycle(ctrl, workload, 1, CYCLE_KINDS[0], lambda _: None)
    assert not result.exact
    assert result.tags["weights"].check == "DIFFERS"
    assert result.tags["runtime"].check == "exact"
    assert "NOT EXACT" in render(result, 1)
    workload.close()


def test_failed_check_makes_the_demo_exit_1(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """When a check finds different bytes, `torpor demo` says so and exits 1."""
    from torpor.demo import sim

    real_check = sim.SimWorkload.check

    def lying_check(self: sim.SimWorkload, tags: list[str], refilled: list[str], reloaded: list[str]) -> object:
        result = real_check(self, tags, refilled, reloaded)
        return type(result)(False, "bytes differ", {t: "DIFFERS" for t in result.per_tag})

    monkeypatch.setattr(sim.SimWorkload, "check", lying_check)
    assert main(["demo", "--cycles", "1", "--device", "sim", "--log-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "NOT EXACT" in out and "SOME WAKES WERE NOT EXACT" in out


def test_cycle_kinds_rotate() -> None:
    """Cycle i runs CYCLE_KINDS[i % 3]: L1 full, L1 selective, L2 with reload, then L1 full again."""
    assert [k.level for k in CYCLE_KINDS] == [1, 1, 2]
    assert CYCLE_KINDS[1].wakes == (("weights",), ("kv_cache",))
    assert CYCLE_KINDS[2].reload_weights and not CYCLE_KINDS[0].reload_weights


def test_device_auto_picks_sim_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """--device auto is sim when CUDA is absent and cuda when present; --device cuda without CUDA is an error."""
    monkeypatch.setattr(demo_run, "cuda_available", lambda: False)
    assert pick_device("auto")[0] == "sim"
    assert pick_device("sim")[0] == "sim"
    with pytest.raises(ValueError, match="use --device sim"):
        pick_device("cuda")
    monkeypatch.setattr(demo_run, "cuda_available", lambda: True)
    assert pick_device("auto")[0] == "cuda"
    assert pick_device("sim")[0] == "sim"


def test_demo_cuda_without_gpu_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor demo --device cuda` on a machine without CUDA: exit 1 and one line saying to use sim."""
    monkeypatch.setattr(demo_run, "cuda_available", lambda: False)
    assert main(["demo", "--device", "cuda"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device sim" in err[0]


def test_demo_recovers_an_interrupted_log(tmp_path: Path) -> None:
    """A --log-dir whose log ends mid-sleep: the demo says so, recovers, and runs exact."""
    from torpor.testing import FakeMemory

    ctrl = SleepController(FakeMemory({"weights": MiB}), log=tmp_path, engine="demo", fsync=False)
    ctrl.sleep(1)
    ctrl.log.close()  # type: ignore[union-attr]
    log = tmp_path / "demo.rank0.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if '"kind":"sleep_requested"' in line) + 1
    log.write_text("".join(lines[:cut]))
    assert replay(log).interrupted
    import io

    buf = io.StringIO()
    assert run_demo(DemoOptions(cycles=1, device="sim", log_dir=tmp_path, out=buf)) == 0
    assert "ends mid-transition" in buf.getvalue() and "recovering" in buf.getvalue()
    kinds = [e.kind for e in read_events(log)]
    assert EventKind.RECOVERED in kinds and replay(log).state is State.AWAKE


@pytest.mark.gpu
def test_demo_on_cuda_is_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a GPU, three cycles of the decoder replay every graph bit-exact."""
    assert main(["demo", "--cycles", "3", "--device", "cuda", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "on device 'cuda'" in out and "every wake was bit-exact" in out
    assert out.count("outputs of 6 replayed graphs bit-exact") == 3
    assert out.count("asleep: the device kept") == 3


def test_keep_serving_serves_metrics_until_ctrl_c() -> None:
    """`--keep-serving` keeps /metrics up after the cycles (torpor_ series) until SIGINT, even one inherited as ignored; then exits 130."""
    import signal
    import urllib.request

    proc = subprocess.Popen(
        [*_torpor(), "demo", "--cycles", "1", "--device", "sim", "--port", "0", "--keep-serving"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # started as a background job of a shell would be: SIGINT ignored (the demo must still stop on it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509 - no threads in the child yet
    )
    try:
        assert proc.stdout is not None
        url = ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            found = re.match(r"serving (http://127\.0\.0\.1:\d+/metrics) until Ctrl-C", line)
            if found:
                url = found.group(1)
                break
        assert url, "the demo never said it was serving"
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - loopback URL the demo printed
            body = resp.read().decode()
        assert "torpor_" in body and 'torpor_engine="demo"' in body
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err  # Ctrl-C, as every command exits on it (it was 0)
    assert "stopped serving" in out and "Traceback" not in err


def test_port_in_use_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --port another process holds: exit 1, one line naming the port and what to do, the log closed."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        rc = main(["demo", "--device", "sim", "--port", str(port), "--log-dir", str(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "pick another --port" in err[0]
    assert [e.kind for e in read_events(tmp_path / "demo.rank0.jsonl")][-1] is EventKind.CLOSED


@pytest.mark.parametrize("host", ["999.1.1.1", "192.0.2.1"])
def test_a_host_that_is_no_address_here_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str], host: str) -> None:
    """--host 999.1.1.1 (no address) or one of no interface here: exit 1, one line about --host, not "pick another --port"."""
    rc = main(["demo", "--device", "sim", "--host", host, "--log-dir", str(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--host {host}" in err[0] and "--port" not in err[0], err


def test_auto_falls_back_to_sim_when_cuda_cannot_be_used(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--device auto with CUDA present but unusable runs on the simulated device and says why; --device cuda fails."""
    real = demo_run.make_workload

    def broken_cuda(device: str):  # type: ignore[no-untyped-def]
        if device == "cuda":
            msg = "cuInit failed: CUDA_ERROR_NO_DEVICE"
            raise demo_run.DemoError(msg)
        return real(device)

    monkeypatch.setattr(demo_run, "cuda_available", lambda: True)
    monkeypatch.setattr(demo_run, "make_workload", broken_cuda)
    assert main(["demo", "--cycles", "1", "--log-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "on device 'sim' (CUDA is available, but torpor cannot use it here: cuInit failed" in out
    assert main(["demo", "--cycles", "1", "--device", "cuda", "--log-dir", str(tmp_path / "b")]) == 1
    assert "cuInit failed" in capsys.readouterr().err


def test_keep_serving_says_serving_only_once_ctrl_c_is_handled() -> None:
    """The "serving ... until Ctrl-C" line comes after the SIGINT/SIGTERM handlers are in place (a reader that signals at once is heard)."""
    import signal
    import types

    from torpor.demo.run import _keep_serving

    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def say(line: str) -> None:
        handler = signal.getsignal(signal.SIGINT)
        seen.append(handler)
        if line.startswith("serving "):
            assert handler is not before, "announced serving before Ctrl-C would stop it"
            assert callable(handler)
            handler(signal.SIGINT, None)  # what the reader of the line does next: Ctrl-C

    _keep_serving(types.SimpleNamespace(url="http://127.0.0.1:9/"), True, say)
    assert signal.getsignal(signal.SIGINT) is before
    assert len(seen) == 3  # serving, the curl hint, stopped serving


def test_a_log_dir_that_cannot_be_made_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--log-dir under a path that cannot hold a directory: exit 1, one line naming the directory and the fix."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc = main(["demo", "--device", "sim", "--cycles", "1", "--log-dir", str(blocker / "logs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert f"cannot use --log-dir {blocker / 'logs'}" in err[0] and "leave --log-dir out" in err[0]
    assert not err[0].startswith("torpor demo: [Errno")


def test_the_sim_header_says_the_size_the_awake_line_reports(demo_run_output: tuple[int, str, Path]) -> None:
    """The workload line's scaled size (graphs and 2 MiB rounding included) is the 'awake: X tagged' figure."""
    _, out, _ = demo_run_output
    awake = re.search(r"^awake: (\S+ \S+) tagged", out, re.M)
    header = re.search(r"\((\S+ \S+) tagged, each allocation rounded up", out)
    assert awake and header and header.group(1) == awake.group(1), out[:800]


def test_the_first_sleep_says_why_it_is_slower(demo_run_output: tuple[int, str, Path]) -> None:
    """Cycle 1's timing line says the first sleep also pins the host backup that later sleeps reuse."""
    _, out, _ = demo_run_output
    first = out[out.index("cycle 1/3") : out.index("cycle 2/3")]
    later = out[out.index("cycle 2/3") :]
    assert "first sleep also pins" in first and "first sleep also pins" not in later


def test_a_log_dir_that_is_a_file_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--log-dir naming a regular file: exit 1, one line saying it is a file, not a directory (it said "File exists"), the file untouched."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    rc = main(["demo", "--device", "sim", "--cycles", "1", "--log-dir", str(blocker)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert f"cannot use --log-dir {blocker}" in err[0] and "is a file, not a directory" in err[0], err
    assert "File exists" not in err[0] and blocker.read_text() == "mine"


def test_the_sim_header_and_asleep_line_say_what_the_simulated_device_holds(
    demo_run_output: tuple[int, str, Path],
) -> None:
    """The sim header scales the GPU demo's 2.93 GiB (no invented 768 MiB of graphs), and the asleep line calls its 8 MiB the simulated context, not cuBLAS or torch's pool."""
    _, out, _ = demo_run_output
    assert "the GPU demo's weights, kv_cache and runtime (2.93 GiB) scaled 1/64" in out, out[:900]
    assert "3.68 GiB" not in out and "2 MiB granule of graph memory per batch size" in out
    stays = [line for line in out.splitlines() if line.startswith("  asleep: the device kept")]
    assert len(stays) == 3 and all("untagged 8.00 MiB (the simulated driver's stand-in" in s for s in stays), stays
    assert not any("cuBLAS" in s or "torch's default pool" in s for s in stays), stays
