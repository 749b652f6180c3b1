"""Tests of torpor.commands.status: ``torpor status DIR`` prints the engine-wide view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import RigMaker
from test_readmodel_ranklogs import CORRUPTIONS, _corrupt

from torpor.cli import main
from torpor.statemachine import EventLog, SleepController, log_path_for
from torpor.testing import FakeMemory

TAGS = {"weights": 3 << 30, "kv_cache": 2 << 30}


def _ranks(directory: Path, n: int) -> list[SleepController]:
    return [
        SleepController(
            FakeMemory(TAGS), log=EventLog(log_path_for(directory, "llm", r), fsync=False), engine="llm", rank=r
        )
        for r in range(n)
    ]


def test_prints_asleep_and_per_rank_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """All ranks asleep: the summary says asleep (level 1) and each rank shows its tags."""
    for c in _ranks(tmp_path, 2):
        c.sleep(1)
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("engine llm: asleep (level 1), 2 ranks")
    assert out[1].split()[:3] == ["rank", "0", "asleep_l1"]
    assert "weights 3.00 GiB on host" in out[1]
    assert "kv_cache 2.00 GiB discarded" in out[1]


def test_transitional_names_the_lagging_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One rank behind: the summary says transitional and names it."""
    a, _ = _ranks(tmp_path, 2)
    a.sleep(1)
    assert main(["status", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "transitional" in first
    assert "lagging: rank 1 (awake" in first


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_bad_directory_prints_one_line_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str], make: str) -> None:
    """A missing or log-less directory prints one line on stderr and exits non-zero, without a traceback."""
    target = tmp_path / "logs"
    if make == "empty":
        target.mkdir()
    assert main(["status", str(target)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("torpor status: ")
    assert str(target) in lines[0]


def test_unreadable_rank_exits_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A corrupted rank log is shown as unreadable and the exit status is 1."""
    _ranks(tmp_path, 2)
    path = log_path_for(tmp_path, "llm", 0)
    path.write_bytes(b"junk\n")
    assert main(["status", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "unknown" in out
    assert "unreadable" in out


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--json prints the view as JSON."""
    _ranks(tmp_path, 2)
    assert main(["status", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["state"] == "awake"
    assert [r["rank"] for r in data["engines"][0]["ranks"]] == [0, 1]


def test_wait_times_out_with_status_three(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--wait that is not reached within --timeout prints the view and exits 3."""
    _ranks(tmp_path, 1)
    assert main(["status", str(tmp_path), "--wait", "asleep", "--timeout", "0.05"]) == 3
    captured = capsys.readouterr()
    assert "awake" in captured.out
    assert "not asleep" in captured.err


def test_wait_reached_exits_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--wait for the current state returns at once with status 0."""
    for c in _ranks(tmp_path, 2):
        c.sleep(2)
    assert main(["status", str(tmp_path), "--wait", "asleep_l2", "--timeout", "5"]) == 0
    assert "asleep (level 2)" in capsys.readouterr().out


def test_help_has_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    """--help shows what the command does and an example."""
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "example" in out
    assert "torpor status /var/run/torpor" in out
    assert "lag" in out


def test_sizes_are_formatted_like_the_other_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Sizes use the unit that fits (512.00 MiB, 3.00 KiB, 0 B), as `torpor log` and the demo print them, not 0.50 GiB."""
    memory = FakeMemory({"weights": 512 << 20, "kv_cache": 3 << 10})
    c = SleepController(memory, log=EventLog(log_path_for(tmp_path, "small", 0), fsync=False), engine="small", rank=0)
    c.sleep(1)
    assert main(["status", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert line.endswith("kv_cache 3.00 KiB discarded, weights 512.00 MiB on host"), line


def test_shows_pinned_host_memory_budget_and_what_stayed_on_the_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make_rig: RigMaker
) -> None:
    """Each rank's second line gives pinned host bytes, the budget and the device memory kept at the last sleep."""
    from torpor import HostMemoryPolicy, Policy

    alloc = make_rig("cuda_like", overhead=1 << 28, slab_bytes=0).allocator
    alloc.allocate(1 << 28, "weights")
    alloc.allocate(1 << 28, "kv_cache")
    ctl = SleepController(
        alloc,
        log=EventLog(log_path_for(tmp_path, "llm", 0), fsync=False),
        engine="llm",
        policy=Policy(host=HostMemoryPolicy(budget_bytes=1 << 29)),
    )
    ctl.sleep(1)
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "host pinned 256.00 MiB (budget 512.00 MiB; pinned at_sleep, keep after wake)" in out[2]
    assert "the GPU kept 256.00 MiB in use: torpor tags 0 B, untagged 256.00 MiB" in out[2]
    assert main(["status", str(tmp_path), "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)["engines"][0]["ranks"][0]
    assert rank["device_asleep"]["untagged"] == 1 << 28 and rank["pinned_bytes"] == 1 << 28
    alloc.close()


def _dead_writer(directory: Path) -> None:
    """Rank 0 of engine llm, cut inside its second sleep, by a child process that has exited (its writer is gone)."""
    import subprocess
    import sys

    code = (
        "import sys; from torpor.statemachine import SleepController; from torpor.testing import FakeMemory\n"
        f"c = SleepController(FakeMemory({TAGS!r}), log=sys.argv[1], engine='llm', rank=0, fsync=False)\n"
        "c.sleep(1); c.wake(); c.sleep(1)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, timeout=120)
    path = directory / "llm.rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    cut = max(i for i, line in enumerate(lines) if '"kind":"sleep_requested"' in line) + 2
    path.write_text("".join(lines[:cut]))


def test_an_interrupted_rank_is_named_with_its_writer_gone_and_exits_four(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log cut mid-sleep by a dead writer: no empty 'lagging:', the summary says interrupted and whose pid, exit 4."""
    _dead_writer(tmp_path)
    assert main(["status", str(tmp_path)]) == 4
    out = capsys.readouterr().out.splitlines()
    assert "lagging: " not in out[0] and out[0].startswith("engine llm: suspending, 1 rank; INTERRUPTED")
    assert "gone mid-command" in out[0] and "recover()" in out[0]
    assert main(["status", str(tmp_path), "--json"]) == 4
    assert json.loads(capsys.readouterr().out)["engines"][0]["interrupted"] == [0]


def test_a_rank_mid_command_with_its_writer_running_is_in_flight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank inside the same transition while its writer runs: 'a command is in flight', nobody lags, exit 0."""
    (ctrl,) = _ranks(tmp_path, 1)
    ctrl.sleep(1)
    ctrl.log.close()  # type: ignore[union-attr]
    path = tmp_path / "llm.rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: 1 + next(i for i, x in enumerate(lines) if '"sleep_requested"' in x)]))
    assert main(["status", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "engine llm: suspending, 1 rank; a command is in flight"


@pytest.mark.parametrize(
    ("case", "state", "interrupted", "exit_status"),
    [("live", "asleep_l1", False, 0), ("closed", "closed", False, 0), ("interrupted", "suspending", True, 4)],
)
def test_every_reader_agrees_on_state_closed_and_counts(
    case: str, state: str, interrupted: bool, exit_status: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torpor status, torpor log replay, /state and Client say the same state, interrupted flag and allocation counts."""
    from torpor.client import Client
    from torpor.telemetry import serve

    live = None
    if case == "interrupted":
        _dead_writer(tmp_path)
    else:
        (live,) = _ranks(tmp_path, 1)
        live.sleep(1)
        if case == "closed":
            live.close()
    path = tmp_path / "llm.rank0.jsonl"

    assert main(["status", str(tmp_path), "--json"]) == exit_status
    rank = json.loads(capsys.readouterr().out)["engines"][0]["ranks"][0]
    assert main(["log", "replay", "--json", str(path)]) == exit_status
    replayed = json.loads(capsys.readouterr().out)
    with serve(path) as server:
        client = Client(server.url, rank=0, engine="llm")
        served = client.status()
        answers = {"status": rank["state"], "replay": replayed["state"], "/state": served["state"]}
        answers["Client"] = client.state()
    assert answers == dict.fromkeys(answers, state)
    assert replayed["interrupted"] is served["interrupted"] is interrupted
    assert replayed["closed"] is served["closed"] is (case == "closed")
    counts = [
        {t: u["allocations"] for t, u in where.items()}
        for where in (rank["residency"], replayed["residency"], served["residency"])
    ]
    assert counts == [dict.fromkeys(TAGS, 1)] * 3  # FakeMemory: one allocation per tag, as its usage() says
    if live is not None and case == "live":
        assert {t: u.allocations for t, u in live.memory.usage().items()} == counts[0]
        live.close()


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "soon"])
def test_a_timeout_that_is_no_finite_number_of_seconds_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    """--timeout nan (which passes every comparison, so --wait never ended), inf, -1 or a word: usage error 2, one line."""
    _ranks(tmp_path, 1)
    with pytest.raises(SystemExit) as info:
        main(["status", str(tmp_path), "--wait", "asleep", "--timeout", bad])
    assert info.value.code == 2
    assert "finite number of seconds" in capsys.readouterr().err


def test_closed_is_dated_from_the_closed_event(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank whose engine closed its log reads "closed since #N" with N the closed event, not the sleep before it."""
    (ctrl,) = _ranks(tmp_path, 1)
    ctrl.sleep(1)
    slept = ctrl.last_seq
    ctrl.close()
    assert main(["status", str(tmp_path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("rank 0"))
    assert f"since #{slept + 1} " in line and f"#{slept} " not in line, line


def test_a_missing_rank_is_named_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--world-size 2 with rank 1's log missing says "no log for rank 1" and the file it looked for."""
    _ranks(tmp_path, 1)
    main(["status", str(tmp_path), "--world-size", "2"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("rank 1"))
    assert "no log for rank 1" in line and "llm.rank1.jsonl" in line and "ENGINE" not in line, line


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_log_corrupted_past_its_first_line_is_reported_corrupted_and_exits_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """status on an asleep engine's log with a bad line after good ones says unreadable naming the line and exits 1, as log show does."""
    for c in _ranks(tmp_path, 2):
        c.sleep(1)
    path = log_path_for(tmp_path, "llm", 0)
    _corrupt(path, how)
    assert main(["log", "show", str(path)]) == 1
    capsys.readouterr()
    assert main(["status", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("engine llm: unknown"), out
    assert "unreadable" in out and "corrupted" in out
    assert "in flight" not in out and "INTERRUPTED" not in out


@pytest.mark.parametrize("world_size", ["0", "-5", "20000", "two"])
def test_a_world_size_no_engine_has_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], world_size: str
) -> None:
    """--world-size -5 and 0 were taken and 20000 took 7 s: outside 1..4096 it is a usage error (exit 2) naming the range."""
    _ranks(tmp_path, 1)
    with pytest.raises(SystemExit) as exit_:
        main(["status", str(tmp_path), "--world-size", world_size])
    assert exit_.value.code == 2
    assert "not a number of ranks from 1 to 4096" in capsys.readouterr().err
