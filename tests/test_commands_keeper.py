"""``torpor keeper``: its help, its arguments, what serve, status and drop print, and their exit statuses."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from keeper_engine import ROOT, running_keeper

from torpor.cli import build_parser, main
from torpor.commands.keeper import format_status
from torpor.keeper import KeeperLink
from torpor.units import MiB


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Path]:
    """A keeper process at a socket of its own; killed after the test."""
    sock = tmp_path / "k" / "keeper.sock"
    with running_keeper(sock):
        yield sock


def _keeper_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    keeper = top.choices["keeper"]
    actions = next(a for a in keeper._actions if isinstance(a, argparse._SubParsersAction))
    return {"keeper": keeper, **actions.choices}


def test_the_help_example_runs_as_written(tmp_path: Path) -> None:
    """The example in `torpor keeper --help` works pasted into a shell: its status finds the keeper it started."""
    epilog = _keeper_parsers()["keeper"].epilog or ""
    example = epilog.removeprefix("example: ").strip()
    assert example.startswith("torpor keeper serve"), epilog
    env = {**os.environ, "TORPOR_KEEPER_SOCKET": str(tmp_path / "k" / "keeper.sock")}
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env['PATH']}"
    if shutil.which("torpor", path=env["PATH"]) is None:
        pytest.skip("no torpor command on PATH (the package is not installed in a venv here)")
    script = f"{example}\nstatus=$?\nkill %1\nwait\nexit $status\n"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "engines: none" in done.stdout


def test_keeper_without_an_action_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor keeper` alone exits 2 with one line naming the actions, not the whole help."""
    assert main(["keeper"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "serve, status or drop" in captured.err, captured.err


def test_each_action_has_a_description() -> None:
    """serve, status and drop each say on their help page what they do."""
    parsers = _keeper_parsers()
    for action in ("serve", "status", "drop"):
        assert parsers[action].description, action


@pytest.mark.parametrize("budget", ["-5G", "0", "9" * 400, "1e400", "64Q"])
def test_a_bad_budget_is_a_one_line_usage_error(budget: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--budget that is negative, zero, 400 digits or not a size exits 2 with one line saying what a budget is."""
    with pytest.raises(SystemExit) as info:
        main(["keeper", "serve", "--budget", budget, "--socket", "/nonexistent/k.sock"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a positive byte count" in err, err


def test_a_socket_whose_directory_cannot_be_made_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """keeper serve --socket /proc/nope/k.sock exits 1 with one line naming the directory it could not make."""
    assert main(["keeper", "serve", "--socket", "/proc/nope/k.sock"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot make its directory /proc/nope" in err, err


def test_drop_names_the_engine_and_says_drop(keeper: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """keeper drop of an engine with no backup exits 1 saying nothing was dropped, naming it; never 'adopt' or '?'."""
    assert main(["keeper", "drop", "nope", "--socket", str(keeper)]) == 1
    err = capsys.readouterr().err
    assert "nothing to drop" in err and "'nope'" in err, err
    assert "adopt" not in err and "'?'" not in err, err


def test_status_prints_sizes(keeper: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """keeper status prints the budget, the bytes held and each backup's bytes as sizes."""
    with KeeperLink(keeper) as link:
        link.hello("e")
        _, fd = link.create(2 * MiB)
        os.close(fd)
        assert main(["keeper", "status", "--socket", str(keeper)]) == 0
    out = capsys.readouterr().out
    assert "holds 2.00 MiB of 1.00 GiB in 1 regions" in out, out


def test_status_escapes_names_it_prints() -> None:
    """Names with a newline or an ESC sequence (a keeper of another version, a hostile one) print escaped: no forged line."""
    now = time.time()
    forged = "x\nkeeper pid 1 at /forged (uid 0, up 0 s)"
    state = {
        "keeper_pid": 7,
        "socket": "/run/k\x1b[2J.sock",
        "uid": 0,
        "uptime_s": 5.0,
        "used": 4096,
        "budget": 64 << 30,
        "regions": 1,
        "engines": [{"engine": forged, "pid": 3, "alive": False, "since": now, "ended": now}],
        "backups": [
            {"backup": "b\x1b]0;title\x07", "engine": forged, "pid": 3, "tags": ["w\ni"], "bytes": 4096}
            | {"age_s": 1.0, "model": "m\r\n", "adopter": None}
        ],
        "adoptions": [],
    }
    text = format_status(state)
    assert "\x1b" not in text and "\r" not in text and "\x07" not in text
    assert len(text.splitlines()) == 6, text
    assert "x\\nkeeper pid 1 at /forged" in text and "budget" not in text.splitlines()[0]
    assert "holds 4.00 KiB of 64.00 GiB in 1 regions" in text


@pytest.mark.parametrize("wait", ["-1", "nan", "inf", "soon"])
def test_a_bad_wait_is_a_one_line_usage_error(wait: str, capsys: pytest.CaptureFixture[str]) -> None:
    """keeper status --wait that is negative, nan, inf or no number exits 2 with one line."""
    with pytest.raises(SystemExit) as info:
        main(["keeper", "status", "--wait", wait, "--socket", "/nonexistent/k.sock"])
    assert info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
