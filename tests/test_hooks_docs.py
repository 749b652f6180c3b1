"""Tests of docs/hooks.md: the worked RL-loop example runs and prints what the page says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "hooks.md"


def _blocks() -> tuple[str, str]:
    text = DOC.read_text()
    after = text.split("<!-- worked-example -->", 1)[1]
    code = re.search(r"```python\n(.*?)```", after, re.S)
    shown = re.search(r"```text\n(.*?)```", after, re.S)
    if code is None or shown is None:
        pytest.fail("docs/hooks.md lost its worked example or its printed output")
    return code.group(1), shown.group(1)


def test_worked_example_runs_and_prints_what_the_docs_show(capsys: pytest.CaptureFixture[str]) -> None:
    """The RL loop in docs/hooks.md runs on the CPU and prints exactly the output shown under it."""
    code, shown = _blocks()
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_hooks_example"})  # noqa: S102  (our own docs)
    assert capsys.readouterr().out == shown


def test_status_sample_matches_the_renderer(tmp_path: Path) -> None:
    """The sample `torpor status` output in the docs has the shape the renderer prints."""
    from torpor.commands.status import render
    from torpor.hooks import fleet
    from torpor.statemachine import EventLog, SleepController, log_path_for
    from torpor.testing import FakeMemory

    tags = {"weights": 16 << 30, "kv_cache": 40 << 30}
    ranks = [
        SleepController(
            FakeMemory(tags), log=EventLog(log_path_for(tmp_path, "policy", r), fsync=False), engine="policy", rank=r
        )
        for r in range(2)
    ]
    ranks[0].sleep(1)
    out = render(fleet(tmp_path)).splitlines()
    sample = DOC.read_text().split("$ torpor status /var/run/torpor\n", 1)[1].splitlines()
    pattern = re.compile(r"\d{2}:\d{2}:\d{2}|#\d+|pid \d+")
    assert pattern.sub("X", out[0]).split(", rank")[0] == pattern.sub("X", sample[0]).split(", rank")[0]
    assert out[1].split()[:3] == sample[1].split()[:3]
    assert "kv_cache 40.00 GiB discarded, weights 16.00 GiB on host" in out[1]
