"""Tests for torpor.telemetry.timeline and `torpor plot`: the timeline from an event log."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor import SleepController, State
from torpor.cli import main
from torpor.statemachine.log.logsource import resolve_log
from torpor.statemachine.log.reader import read_events
from torpor.telemetry.timeline import STATE_COLOURS, plot, timeline
from torpor.testing import FakeMemory

TAGS = {"weights": 4 << 20, "kv_cache": 8 << 20, "cudagraph": 1 << 20}


def make_log(directory: Path, engine: str = "demo", rank: int = 0) -> Path:
    """A log of one level-1 sleep, a partial wake and a full wake."""
    controller = SleepController(FakeMemory(TAGS), log=directory, engine=engine, rank=rank, fsync=False)
    controller.sleep(1)
    controller.wake(["weights"])
    controller.wake()
    controller.close()
    return directory / f"{engine}.rank{rank}.jsonl"


def test_timeline_follows_residency_and_states(tmp_path: Path) -> None:
    """The timeline has a sample per event, the right bytes by residency, and the states in order."""
    log = make_log(tmp_path)
    events = list(read_events(log))
    tl = timeline(events)
    assert len(tl.times) == len(events)
    asleep_at = next(i for i, e in enumerate(events) if e.kind.value == "sleep_completed")
    assert tl.bytes["weights"]["host"][asleep_at] == TAGS["weights"]
    assert tl.bytes["kv_cache"]["discarded"][asleep_at] == TAGS["kv_cache"]
    assert tl.bytes["weights"]["resident"][0] == TAGS["weights"]
    assert tl.bytes["kv_cache"]["resident"][-1] == TAGS["kv_cache"]
    states = [s for _, _, s in tl.states]
    assert states == [
        State.AWAKE,
        State.SUSPENDING,
        State.ASLEEP_L1,
        State.RESUMING,
        State.PARTIALLY_AWAKE,
        State.RESUMING,
        State.AWAKE,
    ]
    assert all(a <= b for a, b, _ in tl.states)


def test_plot_writes_a_png_with_state_bands(tmp_path: Path) -> None:
    """plot() writes a PNG in which the asleep_l1 band colour appears."""
    import matplotlib.image
    from matplotlib.colors import to_rgb

    out = plot(make_log(tmp_path), tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(out))[:, :, :3]
    assert pixels.shape[0] > 500
    assert pixels.shape[1] > 800
    band = [0.7 * c + 0.3 for c in to_rgb(STATE_COLOURS[State.ASLEEP_L1])]
    close = (abs(pixels - band) < 0.02).all(axis=2)
    assert close.sum() > 1000


def test_cli_plots_a_log_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor plot DIR -o FILE` finds the one log in the directory and writes the PNG."""
    make_log(tmp_path / "logs")
    out = tmp_path / "timeline.png"
    assert main(["plot", str(tmp_path / "logs"), "-o", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert str(out) in capsys.readouterr().out


def test_a_directory_with_several_logs_needs_a_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With two ranks' logs in a directory, plot asks for --rank (exit 1, one line), and --rank picks one."""
    make_log(tmp_path, rank=0)
    make_log(tmp_path, rank=1)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "x.png")]) == 1
    assert "pick one with --engine and --rank" in capsys.readouterr().err
    assert resolve_log(tmp_path, rank=1).name == "demo.rank1.jsonl"


def test_missing_log_is_an_error_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A log that does not exist gives exit status 1 and a one-line message."""
    assert main(["plot", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "x.png")]) == 1
    assert "no event log" in capsys.readouterr().err


def test_a_wall_time_that_is_no_date_fails_in_one_line_and_draws_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checksummed line with wall=1e20: `torpor plot` exits 1 in one line naming it (or its line), and writes no PNG."""
    pytest.importorskip("matplotlib")
    from dataclasses import replace

    from torpor.statemachine.log.codec import encode_line

    log = make_log(tmp_path)
    last = list(read_events(log))[-1]
    with open(log, "ab") as fh:
        fh.write(encode_line(replace(last, seq=last.seq + 1, wall=1e20)))
    out = tmp_path / "bad.png"
    assert main(["plot", str(log), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "1e+20" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()
