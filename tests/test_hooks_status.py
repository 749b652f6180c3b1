"""Tests of torpor.commands.status: ``torpor status DIR`` prints the engine-wide view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank's second line gives pinned host bytes, the budget and the device memory kept at the last sleep."""
    from torpor import HostMemoryPolicy, Policy
    from torpor.allocator import SimDriver, TaggedAllocator

    alloc = TaggedAllocator(SimDriver(1 << 30, overhead=1 << 28), slab_bytes=0)
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
