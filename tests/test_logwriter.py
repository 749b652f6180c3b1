"""Tests for torpor.statemachine.logwriter: what a rotation reads of the active file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from torpor.statemachine import tail
from torpor.statemachine.events import EventKind, make_event
from torpor.statemachine.log import read_events, segments
from torpor.statemachine.logwriter import EventLog
from torpor.statemachine.projection import Projection


def test_a_rotation_reads_only_the_first_line_of_the_active_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rotating names the segment from its first event without reading the whole file (the writer lock is held)."""
    path = tmp_path / "e.rank0.jsonl"

    def whole_file(file: Any) -> Any:
        msg = f"a rotation read the whole of {file}"
        raise AssertionError(msg)

    snapshot = {"projection": Projection().to_dict()}
    with EventLog(path, fsync=False, max_bytes=600) as log:
        monkeypatch.setattr(tail, "_read_file", whole_file)
        for _ in range(3):
            for _ in range(10):
                log.append(make_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))
            log.rotate(make_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, snapshot))
        monkeypatch.undo()
    assert len(segments(path)) == 4
    assert [e.seq for e in read_events(path)] == list(range(1, 34))
