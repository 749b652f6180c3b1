"""The CLI a user meets first: help with examples, one-line errors, and ``torpor log show|follow|replay``."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import RigMaker

from torpor.cli import build_parser, main
from torpor.statemachine import SleepController, read_events, replay
from torpor.testing import FakeMemory

EXAMPLE = re.compile(r"examples?:\s+torpor ")
TAGS = {"weights": 3 << 20, "kv_cache": 5 << 20, "runtime": 1 << 20}


def _torpor() -> list[str]:
    """The installed ``torpor`` script beside this Python, else ``python -m torpor.cli``."""
    script = Path(sys.executable).with_name("torpor")
    return [str(script)] if script.exists() else [sys.executable, "-m", "torpor.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_torpor(), *args], capture_output=True, text=True, timeout=120, check=False)


def _log(tmp_path: Path, *, interrupted: bool = False) -> Path:
    """A log with a capture, a level-1 sleep, a selective wake and a level-2 sleep."""
    (tmp_path / "logs").mkdir()
    ctrl = SleepController(FakeMemory(TAGS), log=tmp_path / "logs", engine="eng", fsync=False)
    with ctrl.capture("decode batch=8"):
        pass
    ctrl.sleep(1)
    ctrl.wake(["weights"])
    ctrl.wake(["kv_cache"])
    ctrl.sleep(2)
    path = tmp_path / "logs" / "eng.rank0.jsonl"
    if interrupted:
        ctrl.log.close()  # type: ignore[union-attr]
        lines = path.read_text().splitlines(keepends=True)
        cut = max(i for i, line in enumerate(lines) if '"kind":"sleep_requested"' in line) + 2
        path.write_text("".join(lines[:cut]))
    else:
        ctrl.close()
    return path


def _dead_writer_log(tmp_path: Path, engine: str = "eng", rank: int = 0) -> Path:
    """A log cut mid-sleep whose writer is gone: written by a child process that has exited."""
    code = (
        "import sys; from torpor.statemachine import SleepController; from torpor.testing import FakeMemory\n"
        f"c = SleepController(FakeMemory({TAGS!r}), log=sys.argv[1], engine={engine!r}, rank={rank}, fsync=False)\n"
        "c.sleep(1); c.wake(); c.sleep(2)\n"
    )
    (tmp_path / "logs").mkdir()
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "logs")], check=True, timeout=120)
    path = tmp_path / "logs" / f"{engine}.rank{rank}.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    cut = max(i for i, line in enumerate(lines) if '"kind":"sleep_requested"' in line) + 2
    path.write_text("".join(lines[:cut]))
    return path


def _huge_wall_log(tmp_path: Path) -> Path:
    """A log whose last line is checksummed and well formed but says wall=1e20 (no platform date)."""
    from dataclasses import replace

    from torpor.statemachine.log.codec import encode_line

    path = _log(tmp_path)
    events = list(read_events(path))
    bad = replace(events[-1], seq=events[-1].seq + 1, wall=1e20)
    with open(path, "ab") as fh:
        fh.write(encode_line(bad))
    return path


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


# -- help and bad arguments ---------------------------------------------------------------


def test_every_command_help_has_an_example() -> None:
    """--help of the top level, every subcommand and every log action shows an example command."""
    top = build_parser()
    parsers = {"torpor": top}
    for name, sub in _subparsers(top).items():
        parsers[f"torpor {name}"] = sub
        for action, nested in _subparsers(sub).items():
            parsers[f"torpor {name} {action}"] = nested
    assert {"torpor demo", "torpor log show", "torpor log follow", "torpor log replay"} <= set(parsers)
    missing = [name for name, p in parsers.items() if not EXAMPLE.search(p.format_help())]
    assert not missing, f"--help without an example: {missing}"


def test_help_runs_as_a_program() -> None:
    """`torpor --help` exits 0 and lists demo and log."""
    proc = _run("--help")
    assert proc.returncode == 0
    assert "demo" in proc.stdout and "log" in proc.stdout


def test_no_command_prints_help_and_fails() -> None:
    """`torpor` alone prints the help and exits 2."""
    assert main([]) == 2


def test_log_without_action_fails_with_one_hint(capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor log` with no action says which actions exist and exits 2."""
    assert main(["log"]) == 2
    assert "show, follow or replay" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["demo", "--cycles", "many"], "argument --cycles: 'many' is not a whole number"),
        (["demo", "--device", "tpu"], "invalid choice"),
        (["log", "show"], "required: PATH"),
        (["log", "replay", "x", "--frobnicate"], "unrecognized arguments"),
    ],
)
def test_bad_arguments_fail_without_traceback(args: list[str], needle: str) -> None:
    """Bad arguments exit 2 with an error line naming the problem and no traceback."""
    proc = _run(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr.splitlines()[-1]


@pytest.mark.parametrize("cycles", ["0", "-1", "-3"])
def test_demo_rejects_no_cycles(cycles: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor demo --cycles 0` is a usage error (exit 2, as every bad argument; it was 1) in one line saying at least 1."""
    assert _exit_code(["demo", "--cycles", cycles, "--device", "sim"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torpor demo: error: argument --cycles" in err[0] and "at least 1" in err[0], err


@pytest.mark.parametrize("port", ["70000", "99999", "-1"])
def test_demo_rejects_a_port_out_of_range(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor demo --port 99999` (or -1) is a usage error (exit 2; it was 1) in one line naming the range."""
    assert _exit_code(["demo", "--port", port, "--device", "sim"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --port" in err[0] and "65535" in err[0], err


# -- unreadable inputs to torpor log --------------------------------------------------------


@pytest.mark.parametrize("action", ["show", "replay"])
def test_missing_log_is_one_line(action: str, tmp_path: Path) -> None:
    """A log path that does not exist: one line on stderr, exit 1, no traceback (`follow` waits for it: below)."""
    proc = _run("log", action, str(tmp_path / "nope.jsonl"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"torpor log: no event log at {tmp_path / 'nope.jsonl'}"]


def test_corrupted_log_is_one_line(tmp_path: Path) -> None:
    """A log with a garbage line in the middle: one line naming file and line, exit 1."""
    path = _log(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = "not json at all\n"
    path.write_text("".join(lines))
    proc = _run("log", "show", str(path))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and f"{path}:3" in err[0] and "corrupted" in err[0]


def test_directory_without_log_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory holding no *.jsonl: exit 1 naming the directory."""
    assert main(["log", "show", str(tmp_path)]) == 1
    assert f"no event log (*.jsonl) in directory {tmp_path}" in capsys.readouterr().err


def test_directory_with_two_logs_asks_for_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory with two rank logs: exit 1 naming both files."""
    for rank in (0, 1):
        SleepController(FakeMemory(TAGS), log=tmp_path, engine="eng", rank=rank, fsync=False).close()
    assert main(["log", "replay", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "eng.rank0.jsonl" in err and "eng.rank1.jsonl" in err and "name one" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_log_is_one_line(tmp_path: Path) -> None:
    """A log file without read permission: one line with the OS error, exit 1."""
    path = _log(tmp_path)
    path.chmod(0)
    try:
        proc = _run("log", "replay", str(path))
    finally:
        path.chmod(0o600)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "Permission denied" in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["plot", "{tmp}/nope.jsonl", "-o", "{tmp}/x.png"], "no event log"),
        (["status", "{tmp}/nowhere"], "no such directory"),
        (["dashboard", "-o", "/proc/nope/x.json"], "No such file or directory"),
        (["diagram", "-o", "/proc/nope/x.md"], "No such file or directory"),
        (["demo", "--device", "sim", "--log-dir", "/proc/nope"], "/proc/nope"),
    ],
)
def test_every_command_fails_on_bad_input_in_one_line(args: list[str], needle: str, tmp_path: Path) -> None:
    """Each command given an unreadable or unwritable path: non-zero, one line naming it, no traceback."""
    proc = _run(*(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith(f"torpor {args[0]}: ")


# -- torpor log show / replay / follow --------------------------------------------------------


def test_show_prints_every_event_with_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`log show` prints one line per event: seq, the state after it, kind and key fields."""
    path = _log(tmp_path)
    assert main(["log", "show", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("#")]
    assert len(rows) == replay(path).last_seq
    released = [r for r in rows if "tag_released" in r and "tag=kv_cache" in r]
    assert released and all("suspending" in r and "action=discard" in r and "5.00 MiB" in r for r in released)
    assert any("partially_awake" in r and "wake_completed" in r for r in rows)


def test_show_and_follow_print_ndjson_with_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`log show --json` and `log follow --json` print one event per line, the shape of the endpoints' /events."""
    from torpor.statemachine import read_events

    path = _log(tmp_path)
    events = list(read_events(path))
    assert main(["log", "show", "--json", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [e.to_json() for e in events]
    assert main(["log", "show", "--json", "--kind", "sleep_completed", str(path)]) == 0
    kinds = {json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()}
    assert kinds == {"sleep_completed"}
    assert main(["log", "follow", "--json", "-n", "3", "--timeout", "0", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == [e.to_json() for e in events[-3:]]


def test_show_filters_by_kind_and_seq(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--kind` keeps only those kinds, `--after` only later events; a directory finds its one log."""
    path = _log(tmp_path)
    assert main(["log", "show", str(path.parent), "--kind", "sleep_completed", "--after", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    assert len(rows) == 2
    assert "level=1" in rows[0] and "level=2" in rows[1]


def test_replay_prints_state_and_residency(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`log replay` prints the final state, and per tag the bytes resident, on host and discarded."""
    path = _log(tmp_path)
    assert main(["log", "replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "state       closed at event #" in out and "(the engine closed its log), asleep_l2 since event #" in out
    weights = next(line for line in out.splitlines() if line.startswith("weights"))
    assert weights.split()[1:] == ["asleep", "0", "B", "0", "B", "3.00", "MiB"]
    assert "INTERRUPTED" not in out


def test_replay_json_matches_the_projection(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`log replay --json` prints exactly replay(path).to_dict()."""
    path = _log(tmp_path)
    assert main(["log", "replay", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out) == replay(path).to_dict()


def test_replay_names_the_interrupted_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log cut mid-sleep whose writer is gone: replay says interrupted, names the step and recover(), exits 4."""
    path = _dead_writer_log(tmp_path)
    proj = replay(path)
    assert proj.interrupted
    assert main(["log", "replay", str(path)]) == 4
    out = capsys.readouterr().out
    assert "INTERRUPTED" in out and proj.last_step in out and f"its writer (pid {proj.pid}) is gone" in out
    assert "controller.recover()" in out and "suspending" in out


def test_the_printed_recovery_recipe_reopens_the_same_engine_and_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipe `log replay` prints for an interrupted log, run as printed, recovers that log as its engine and rank."""
    path = _dead_writer_log(tmp_path, engine="llm", rank=3)
    assert main(["log", "replay", str(path)]) == 4
    recipe = next(line.strip() for line in capsys.readouterr().out.splitlines() if "SleepController(" in line)
    assert "engine='llm'" in recipe and "rank=3" in recipe, recipe
    eval(recipe, {"SleepController": SleepController, "memory": FakeMemory(TAGS)})  # noqa: S307  # what a user pastes
    events = list(read_events(path))
    assert {(e.engine, e.rank) for e in events} == {("llm", 3)}, events[-2:]
    assert events[-1].kind == "recovered" and not replay(path).interrupted
    assert main(["status", str(path.parent)]) == 0
    assert "engine llm" in capsys.readouterr().out


def test_replay_of_a_transition_whose_writer_runs_says_in_flight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log that ends mid-sleep while its writer (this process) runs: a command in flight, exit 0."""
    path = _log(tmp_path, interrupted=True)
    assert main(["log", "replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "IN FLIGHT" in out and "INTERRUPTED" not in out and f"pid {os.getpid()}" in out


@pytest.mark.parametrize("action", ["show", "replay", "follow"])
def test_a_wall_time_that_is_no_date_is_one_line_and_exit_1(
    action: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """wall=1e20 in a checksummed line: show, follow and replay print no traceback, say the log is bad, exit 1."""
    path = _huge_wall_log(tmp_path)
    args = ["log", action, str(path)] + (["--timeout", "0.1"] if action == "follow" else [])
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "OverflowError" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1 and "1e+20" in captured.err  # one line naming the value


class _Rows(io.StringIO):
    """Captured stdout that signals when the first timeline row (``#SEQ ...``) has been written."""

    def __init__(self) -> None:
        super().__init__()
        self.first_row = threading.Event()

    def write(self, text: str) -> int:
        """Keep the text; signal on a row."""
        written = super().write(text)
        if text.startswith("#"):
            self.first_row.set()
        return written


def test_follow_prints_events_as_they_are_appended(tmp_path: Path) -> None:
    """`log follow` prints the last N events, then events another writer appends, then stops on --timeout."""
    path = tmp_path / "eng.rank0.jsonl"
    ctrl = SleepController(FakeMemory(TAGS), log=path, engine="eng", fsync=False)
    first = ctrl.last_seq
    out = _Rows()
    got: dict[str, int] = {}

    def follower() -> None:
        with contextlib.redirect_stdout(out):
            got["rc"] = main(["log", "follow", str(path), "-n", "1", "--timeout", "3", "--interval", "0.05"])

    thread = threading.Thread(target=follower)
    thread.start()
    try:
        # Append only once the follower is following (it printed the old event), not after a fixed delay.
        assert out.first_row.wait(60)
        ctrl.sleep(1)
        ctrl.wake()
    finally:
        thread.join(60)
    assert not thread.is_alive()
    assert got["rc"] == 0
    rows = [line for line in out.getvalue().splitlines() if line.startswith("#")]
    assert rows[0].startswith(f"#{first} ")
    assert [int(r.split()[0][1:]) for r in rows] == list(range(first, ctrl.last_seq + 1))
    assert "asleep_l1" in "\n".join(rows) and rows[-1].split()[2] == "awake"
    ctrl.close()


# -- the README a new user reads first ---------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_has_the_two_fresh_machine_commands() -> None:
    """The README's first screen holds the run command and the test command, and .ci/run is executable."""
    readme = (ROOT / "README.md").read_text()
    first_screen = readme[: readme.index("## ")]
    assert "    python3 -m venv .venv && .venv/bin/pip install '.[plot]' && .venv/bin/torpor demo\n" in first_screen
    assert "    .ci/run\n" in first_screen
    assert os.access(ROOT / ".ci" / "run", os.X_OK)


def test_readme_links_resolve() -> None:
    """Every relative link in the README names a file that exists, and its #anchor a heading there."""
    readme = (ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists():
            broken.append(target)
            continue
        if anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.MULTILINE)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"README links that do not resolve: {broken}"


def test_readme_python_examples_compile() -> None:
    """Every ```python block in the README is valid Python."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert blocks
    for block in blocks:
        compile(block.replace("\n...\n", "\npass\n"), "README.md", "exec")


def test_usage_error_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad argument prints exactly one line on stderr and exits 2."""
    from torpor.cli import main

    with pytest.raises(SystemExit) as info:
        main(["demo", "--cycles", "x"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cycles" in err


def test_python_dash_m_torpor_runs_the_cli() -> None:
    """``python -m torpor diagram`` prints the state diagram, like the ``torpor`` script."""
    proc = subprocess.run(
        [sys.executable, "-m", "torpor", "diagram"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("stateDiagram-v2")


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor --version` prints `torpor X.Y.Z` (torpor.__version__, the one source of the version) and exits 0."""
    import torpor

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"torpor {torpor.__version__}\n"
    done = _run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"torpor {torpor.__version__}"


def test_demo_host_binds_the_metrics_endpoint_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor demo --host ADDR` serves its metrics on ADDR and prints that address."""
    assert main(["demo", "--cycles", "1", "--device", "sim", "--host", "127.0.0.2", "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"metrics\s+http://127\.0\.0\.2:\d+/metrics", out), out


def test_bench_progress_goes_to_stderr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torpor bench > bench.md` is clean: progress lines go to stderr, stdout is the Markdown report alone."""
    import types

    import torpor.bench as benchmark
    from torpor.commands import bench

    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setattr(bench, "require", lambda module, feature: fake_torch)

    def fake_run(**kwargs: object) -> dict[str, object]:
        log = kwargs["log"]
        assert callable(log)
        log("workload 8 GiB/64: cycle 1/4")
        return {"rows": []}

    monkeypatch.setattr(benchmark, "run", fake_run)
    monkeypatch.setattr(benchmark, "markdown", lambda data: "| workload | sleep |\n")
    assert main(["bench", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "| workload | sleep |\n\n"
    assert "workload 8 GiB/64: cycle 1/4" in captured.err
    assert (tmp_path / "bench.md").read_text() == "| workload | sleep |\n"


def test_show_formats_every_byte_count_even_nested_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make_rig: RigMaker
) -> None:
    """`log show` prints device={in_use: ...}, host_budget, budget_bytes and host_released as sizes, never raw bytes."""
    from torpor import HostMemoryPolicy, Policy

    alloc = make_rig("cuda_like", capacity=64 << 20).allocator
    alloc.allocate(8 << 20, "weights")
    policy = Policy(host=HostMemoryPolicy(budget_bytes=1 << 30, after_wake="release"))
    ctrl = SleepController(alloc, log=tmp_path / "logs", policy=policy, fsync=False)
    ctrl.sleep(1)
    ctrl.wake()
    ctrl.close()
    assert main(["log", "show", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "total: 64.00 MiB" in out and "host_budget=1.00 GiB" in out and "budget_bytes: 1.00 GiB" in out
    assert "host_released=8.00 MiB" in out or "host_released=0 B" in out
    assert not re.search(r"\b\d{5,}\b", out), [line for line in out.splitlines() if re.search(r"\b\d{5,}\b", line)]


# -- issue 37 item 6: the CLI as a new user meets it -------------------------------------------


def test_a_reader_that_leaves_early_makes_the_command_exit_141(tmp_path: Path) -> None:
    """`torpor demo | head -1` exits 141 (128 + SIGPIPE), not 0 as if every cycle had run."""
    script = (
        f"{' '.join(_torpor())} demo --device sim --cycles 1 --log-dir {tmp_path} | head -1; echo ${{PIPESTATUS[0]}}"
    )
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.stdout.splitlines()[-1] == "141", proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_unknown_option_of_a_command_is_reported_by_that_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor demo --level 3` is a usage error of `torpor demo` (exit 2), not of the top-level parser."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--level", "3"])
    assert info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("torpor demo: error: unrecognized arguments: --level 3"), err


def test_log_without_action_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor log` alone prints one line (no usage block above it) and exits 2."""
    assert main(["log"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "show, follow or replay" in err[0], err


def test_a_device_file_is_not_called_a_corrupted_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor log show /dev/zero` says it is not a regular file, not "corrupted line 1" (nothing was read)."""
    for argv in (["log", "show", "/dev/zero"], ["log", "replay", "/dev/zero"], ["plot", "/dev/zero"]):
        assert main(argv) == 1
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "not a regular file" in err[0], err
        assert "corrupted" not in err[0] and ":1:" not in err[0], err


def test_an_empty_log_gets_one_answer_from_every_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty log: log show, log replay, plot and status all say it holds no complete event yet, and exit 1."""
    (tmp_path / "d").mkdir()
    log = tmp_path / "d" / "llm.rank0.jsonl"
    log.touch()
    for argv in (
        ["log", "show", str(log)],
        ["log", "replay", str(log)],
        ["plot", str(log), "-o", str(tmp_path / "t.png")],
    ):
        assert main(argv) == 1, argv
        captured = capsys.readouterr()
        assert "holds no complete event yet" in captured.err, (argv, captured)
        assert captured.out == "", (argv, captured.out)
    assert main(["status", str(tmp_path / "d")]) == 1
    assert "holds no complete event yet" in capsys.readouterr().out


def test_every_output_option_creates_its_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plot -o`, `dashboard -o` and `diagram -o` into a directory that does not exist yet all create it."""
    log = _log(tmp_path)
    for argv, name in ((["plot", str(log)], "t.png"), (["dashboard"], "d.json"), (["diagram"], "s.md")):
        out = tmp_path / "new" / argv[0] / name
        assert main([*argv, "-o", str(out)]) == 0, (argv, capsys.readouterr().err)
        assert out.is_file()


def test_bench_without_cuda_exits_1_not_the_usage_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torpor bench` on a machine without CUDA is a command that cannot run here (1), not a usage error (2)."""
    from torpor.commands import bench

    fake_torch = argparse.Namespace(cuda=argparse.Namespace(is_available=lambda: False))
    monkeypatch.setattr(bench, "require", lambda *args, **kwargs: fake_torch)
    assert main(["bench"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0], err


@pytest.mark.parametrize("value", ["pinned,nvme", "cuda", ","])
def test_bench_tms_backends_unknown_or_none_is_a_usage_error_naming_the_valid_ones(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """`torpor bench --tms-backends pinned,nvme` (or none) is refused before anything runs: exit 2, the valid names listed."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--real-model", "--tms-backends", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--tms-backends" in err and "the backends are pinned, mmap, disk" in err, err


def test_bench_real_model_passes_the_tms_backends_and_disk_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--real-model --tms-backends disk,mmap --tms-disk-dir D` hands those to the real-model rows; the default is all three."""
    import torpor.bench as benchmark
    from torpor.bench import realmodel
    from torpor.commands import bench

    fake_torch = argparse.Namespace(cuda=argparse.Namespace(is_available=lambda: True))
    monkeypatch.setattr(bench, "require", lambda *args, **kwargs: fake_torch)
    monkeypatch.setattr(benchmark, "markdown", lambda data: "")
    asked: list[dict[str, object]] = []

    def fake_report(*args: object, **kwargs: object) -> dict[str, object]:
        asked.append(kwargs)
        return {"rows": []}

    def fake_run(**kwargs: object) -> dict[str, object]:
        asked.append(kwargs)
        return {"rows": []}

    monkeypatch.setattr(realmodel, "report", fake_report)
    monkeypatch.setattr(benchmark, "run", fake_run)
    out = ["--out", str(tmp_path / "out")]
    assert main(["bench", "--real-model", "--tms-backends", "disk, mmap", "--tms-disk-dir", str(tmp_path), *out]) == 0
    assert main(["bench", "--real-model", *out]) == 0
    assert main(["bench", "--tms-backends", "pinned", *out]) == 0
    assert [(a["backends"], a["disk_parent"]) for a in asked[:2]] == [
        (("disk", "mmap"), tmp_path),
        (("pinned", "mmap", "disk"), None),
    ]
    assert (asked[2]["tms_backends"], asked[2]["disk_dir"]) == (("pinned",), None)


def _broken_links(doc: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path) if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.MULTILINE)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    return broken


def test_doc_links_resolve() -> None:
    """Every relative link in docs/ (docs/bench/history.md included) names a file that exists, and its #anchor a heading."""
    broken = {
        str(doc.relative_to(ROOT)): b for doc in sorted((ROOT / "docs").rglob("*.md")) if (b := _broken_links(doc))
    }
    assert not broken, f"links that do not resolve: {broken}"


def test_readme_contents_lists_every_section() -> None:
    """The README's Contents links every ``##`` section after it, in order."""
    readme = (ROOT / "README.md").read_text()
    contents = readme[readme.index("## Contents") : readme.index("\n## ", readme.index("## Contents") + 1)]
    listed = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)", contents, re.MULTILINE)
    sections = [_slug(h) for h in re.findall(r"^## (.+)$", readme, re.MULTILINE) if h != "Contents"]
    assert listed == sections


def _exit_code(argv: list[str]) -> int:
    """The exit status of ``torpor ARGV`` run in-process (a usage error's SystemExit included)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_each_command_keeps_the_documented_exit_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/cli.md's exit-status table lists exactly the codes the CLI gives, and each command gives its codes."""
    from torpor.commands import bench, diagram

    doc = (ROOT / "docs" / "cli.md").read_text()
    section = doc[doc.index("## Exit status") : doc.index("\n## ", doc.index("## Exit status") + 1)]
    documented = {int(code): where for code, where in re.findall(r"^\| (\d+) \|.*\| ([^|]+) \|$", section, re.M)}
    for sub in ("ok", "dead"):
        (tmp_path / sub).mkdir()
    log = _log(tmp_path / "ok")
    awake = tmp_path / "awake"
    SleepController(FakeMemory(TAGS), log=awake, engine="eng", fsync=False).close()
    (tmp_path / "empty.jsonl").touch()
    cases: dict[int, list[list[str]]] = {
        0: [["diagram"], ["log", "show", str(log)], ["log", "replay", str(log)], ["status", str(log.parent)]],
        1: [
            ["log", "show", str(tmp_path / "empty.jsonl")],
            ["log", "replay", "/dev/zero"],
            ["plot", str(tmp_path / "nope.jsonl")],
            ["status", str(tmp_path / "nowhere")],
            ["dashboard", "-o", "/proc/nope/x.json"],
            ["bench"],  # without CUDA (below)
        ],
        2: [
            ["demo", "--level", "3"],
            ["demo", "--cycles", "0"],
            ["demo", "--port", "99999"],
            ["log"],
            ["log", "show"],
            ["status", str(awake), "--timeout", "1"],
        ],
        3: [["status", str(awake), "--wait", "asleep", "--timeout", "0"]],
        4: [["log", "replay", str(_dead_writer_log(tmp_path / "dead"))], ["status", str(tmp_path / "dead" / "logs")]],
    }
    fake_torch = argparse.Namespace(cuda=argparse.Namespace(is_available=lambda: False))
    monkeypatch.setattr(bench, "require", lambda *args, **kwargs: fake_torch)
    got = {code: [argv for argv in argvs if _exit_code(argv) != code] for code, argvs in cases.items()}
    assert not any(got.values()), f"commands that did not exit with their documented code: {got}"

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(diagram, "run", interrupted)
    assert _exit_code(["diagram"]) == 130
    # 141: a reader that leaves before the end (a timeline longer than a pipe holds, cut by head)
    ctrl = SleepController(FakeMemory(TAGS), log=tmp_path / "long", engine="eng", fsync=False)
    for _ in range(1500):
        ctrl.observe()
    ctrl.close()
    script = f"{' '.join(_torpor())} log show {tmp_path / 'long'} | head -1 >/dev/null; echo ${{PIPESTATUS[0]}}"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.stdout.split() == ["141"] and proc.stderr == "", proc
    assert set(documented) == {*cases, 130, 141}, documented
    assert "status" in documented[3] and "log replay" in documented[4] and "status" in documented[4]
    capsys.readouterr()


@pytest.mark.parametrize(("action", "after"), [("show", "-5"), ("show", "x"), ("follow", "-1")])
def test_a_negative_after_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str, after: str
) -> None:
    """`torpor log show --after -5` was taken: --after is a sequence number >= 0, else a usage error (exit 2)."""
    path = tmp_path / "e.jsonl"
    SleepController(FakeMemory({"weights": 1}), log=path).close()
    with pytest.raises(SystemExit) as exit_:
        main(["log", action, str(path), "--after", after])
    assert exit_.value.code == 2
    assert "is not a sequence number" in capsys.readouterr().err


# -- issue 51: what a new user met --------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "missing", "extra"),
    [
        (["plot", "LOG", "-o", "OUT/t.png"], "matplotlib", "plot"),
        (["bench", "--real-model", "--out", "OUT"], "transformers", "vllm"),
        (["bench", "--vllm", "model", "--out", "OUT"], "vllm", "vllm"),
    ],
)
def test_a_missing_optional_package_is_one_line_naming_its_extra(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    missing: str,
    extra: str,
) -> None:
    """`torpor plot` without matplotlib (and bench's optional packages) is one line naming the extra that brings it, exit 1; it was a traceback."""
    from torpor.commands import bench

    fake_torch = argparse.Namespace(cuda=argparse.Namespace(is_available=lambda: True))
    real_require = bench.require
    monkeypatch.setattr(bench, "require", lambda m, *a, **k: fake_torch if m == "torch" else real_require(m, *a, **k))
    monkeypatch.setitem(sys.modules, missing, None)  # import matplotlib -> ImportError, as where it is not installed
    log = _log(tmp_path)
    argv = [a.replace("LOG", str(log)).replace("OUT", str(tmp_path / "out")) for a in argv]
    assert _exit_code(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"needs {missing}" in err[0] and f"pip install '.[{extra}]'" in err[0], err
    assert err[0].count("'.[") == 1, err  # one extra to install: the cuda extra's "or '.[vllm]'" is not theirs
    assert not re.match(r"torpor (\w+): torpor \1", err[0]), err  # the command is named once
    assert not (tmp_path / "out" / "t.png").exists()


def _start_engine_later(logs: Path, delay: float, *, close: bool) -> threading.Thread:
    """A thread that, after ``delay`` s, opens an engine 'llm' logging into ``logs`` and sleeps it (then closes it, if asked)."""

    def start() -> None:
        time.sleep(delay)
        ctrl = SleepController(FakeMemory(TAGS), log=logs, engine="llm", fsync=False)
        ctrl.sleep(1)
        if close:
            ctrl.close()

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


def test_status_wait_waits_for_an_engine_that_has_not_logged_yet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`status DIR --wait asleep` on a directory with no logs yet waits for the engine (exit 0 once asleep; 3 at its timeout), not exit 1 at once."""
    (tmp_path / "logs").mkdir()
    began = time.monotonic()
    assert _exit_code(["status", str(tmp_path / "logs"), "--wait", "asleep", "--timeout", "0.3"]) == 3
    assert time.monotonic() - began >= 0.3
    assert "not asleep after 0.3 s" in capsys.readouterr().err
    thread = _start_engine_later(tmp_path / "logs", 0.3, close=False)
    assert _exit_code(["status", str(tmp_path / "logs"), "--wait", "asleep", "--timeout", "60"]) == 0
    thread.join(10)
    assert "engine llm: asleep" in capsys.readouterr().out


def test_follow_waits_for_a_log_not_yet_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`log follow` on a log not created yet waits for it, then follows it; at --timeout with no log it exits 1 in one line."""
    path = tmp_path / "logs" / "llm.rank0.jsonl"
    began = time.monotonic()
    assert main(["log", "follow", str(path), "--timeout", "0.5"]) == 1
    assert time.monotonic() - began >= 0.5
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"torpor log: no event log at {path} after waiting 0.5 s (--timeout)", err
    thread = _start_engine_later(tmp_path / "logs", 0.5, close=True)
    assert main(["log", "follow", str(path), "--timeout", "2"]) == 0
    thread.join(10)
    captured = capsys.readouterr()
    assert "sleep_completed" in captured.out and "closed" in captured.out, captured.out
    assert captured.err == f"torpor log: no event log at {path} yet; waiting for it (Ctrl-C to stop)\n"


def test_follow_ended_by_ctrl_c_while_waiting_for_its_log_exits_130(tmp_path: Path) -> None:
    """Ctrl-C while `log follow` waits for a log that is not there yet: exit 130, no traceback."""
    import signal

    proc = subprocess.Popen(
        [*_torpor(), "log", "follow", str(tmp_path / "nope.jsonl")], stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    assert "waiting for it" in proc.stderr.readline()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    assert "Traceback" not in proc.stderr.read()


def test_show_prints_a_refusals_holders_as_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`log show` of a host-budget refusal prints its holders' byte counts as sizes (`8.00 MiB`), never `8388608 bytes`."""
    from torpor import HostMemoryPolicy, Policy
    from torpor.errors import HostBudgetExceeded

    policy = Policy(host=HostMemoryPolicy(budget_bytes=1 << 20))
    ctrl = SleepController(FakeMemory({"weights": 8 << 20, "runtime": 3 << 20}), log=tmp_path / "logs", policy=policy)
    with pytest.raises(HostBudgetExceeded):
        ctrl.sleep(1)
    ctrl.close()
    assert main(["log", "show", str(tmp_path / "logs"), "--kind", "refused"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "holders=[" in line and "8.00 MiB" in line and "3.00 MiB" in line, line
    assert not re.search(r"\b\d{5,}\b", line), line


@pytest.mark.parametrize("command", ["plot", "dashboard", "diagram"])
def test_an_output_that_is_a_directory_is_one_line_naming_the_option(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`dashboard -o DIR` (and diagram's, plot's): exit 1, one line naming `-o DIR` and what to give, not a bare "[Errno 21] Is a directory"."""
    argv = ["plot", str(_log(tmp_path))] if command == "plot" else [command]
    (tmp_path / "out").mkdir()
    assert main([*argv, "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"-o {tmp_path / 'out'}" in err[0] and "is a directory" in err[0], err
    assert "[Errno" not in err[0] and "give a file" in err[0], err
    assert not any((tmp_path / "out").iterdir())


def test_plot_writes_the_file_it_says_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plot -o noext` said "wrote noext" and wrote noext.png: a name that is no .png is refused naming -o; a .png is written where it says."""
    log = _log(tmp_path)
    assert main(["plot", str(log), "-o", str(tmp_path / "noext")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"-o {tmp_path / 'noext'}" in err[0] and ".png" in err[0], err
    assert not list(tmp_path.glob("noext*"))
    assert main(["plot", str(log), "-o", str(tmp_path / "t.PNG")]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 't.PNG'}\n"
    assert (tmp_path / "t.PNG").read_bytes().startswith(b"\x89PNG")
