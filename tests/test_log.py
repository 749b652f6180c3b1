"""Tests for torpor.statemachine.log: checksums, durability, torn lines, corruption, rotation, permissions."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from torpor.errors import EventTooLarge, LogCorrupted, UnknownSchemaVersion
from torpor.statemachine.events import EventKind, make_event
from torpor.statemachine.log import EventLog, encode_line, read_events, read_events_file, segments


def _fill(log: EventLog, n: int, kind: EventKind = EventKind.USAGE_OBSERVED) -> None:
    for _ in range(n):
        log.append(make_event(kind, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))


def test_lines_are_json_with_checksum(tmp_path: Path) -> None:
    """Each line is a JSON object whose crc member checks the rest."""
    with EventLog(tmp_path / "l.jsonl") as log:
        _fill(log, 3)
    lines = (tmp_path / "l.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert all(json.loads(line)["crc"] for line in lines)
    assert [e.seq for e in read_events(tmp_path / "l.jsonl")] == [1, 2, 3]


def test_reopen_continues_sequence(tmp_path: Path) -> None:
    """Reopening a log continues numbering after its last event."""
    with EventLog(tmp_path / "l.jsonl") as log:
        _fill(log, 2)
    with EventLog(tmp_path / "l.jsonl") as log:
        assert log.next_seq() == 3
        _fill(log, 1)
    assert [e.seq for e in read_events(tmp_path / "l.jsonl")] == [1, 2, 3]


def test_out_of_order_append_refused(tmp_path: Path) -> None:
    """Appending an event whose seq does not follow on raises and writes nothing."""
    with EventLog(tmp_path / "l.jsonl") as log:
        _fill(log, 1)
        with pytest.raises(ValueError, match="follow on"):
            log.append(make_event(EventKind.OPENED, 5, "e", 0, {}))
    assert len(list(read_events(tmp_path / "l.jsonl"))) == 1


def test_torn_last_line_tolerated_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A partial last line is skipped with a warning, and cut before the next append."""
    path = tmp_path / "l.jsonl"
    with EventLog(path) as log:
        _fill(log, 2)
    with open(path, "ab") as fh:
        fh.write(encode_line(make_event(EventKind.OPENED, 3, "e", 0, {}))[:20])
    with caplog.at_level(logging.WARNING):
        assert [e.seq for e in read_events(path)] == [1, 2]
    assert "torn last line" in caplog.text
    with EventLog(path) as log:
        assert log.next_seq() == 3
        _fill(log, 1)
    assert [e.seq for e in read_events(path)] == [1, 2, 3]


def test_corrupt_middle_line_names_file_and_line(tmp_path: Path) -> None:
    """A flipped byte in a middle line raises LogCorrupted with the file and line number."""
    path = tmp_path / "l.jsonl"
    with EventLog(path) as log:
        _fill(log, 3)
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1].replace(b"usage", b"usagf")
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(LogCorrupted, match=r"l\.jsonl:2: .*checksum"):
        list(read_events(path))


def test_unknown_schema_version_is_clear(tmp_path: Path) -> None:
    """An event from another schema version raises UnknownSchemaVersion naming it."""
    path = tmp_path / "l.jsonl"
    event = make_event(EventKind.OPENED, 1, "e", 0, {})
    object.__setattr__(event, "schema", 99)
    path.write_bytes(encode_line(event))
    with pytest.raises(UnknownSchemaVersion, match="99"):
        list(read_events(path))


def test_oversized_event_refused(tmp_path: Path) -> None:
    """An event over the line limit raises EventTooLarge and is not written."""
    with EventLog(tmp_path / "l.jsonl", max_line=512) as log:
        with pytest.raises(EventTooLarge, match="512"):
            log.append(make_event(EventKind.USAGE_OBSERVED, 1, "e", 0, {"usage": {"x" * 600: 1}}))
        assert log.next_seq() == 1
    assert (tmp_path / "l.jsonl").read_bytes() == b""


def test_sequence_gap_is_corruption(tmp_path: Path) -> None:
    """A log whose sequence numbers skip raises LogCorrupted."""
    path = tmp_path / "l.jsonl"
    path.write_bytes(
        encode_line(make_event(EventKind.OPENED, 1, "e", 0, {}))
        + encode_line(make_event(EventKind.OPENED, 3, "e", 0, {}))
    )
    with pytest.raises(LogCorrupted, match="jumps"):
        list(read_events(path))


def test_files_private_to_user(tmp_path: Path) -> None:
    """The log file is created 0600 inside a 0700 directory."""
    directory = tmp_path / "logs"
    with EventLog(directory / "l.jsonl") as log:
        _fill(log, 1)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory / "l.jsonl").st_mode) == 0o600


def test_rotation_keeps_replay_correct(tmp_path: Path) -> None:
    """Rotating renames the active file to a segment and the new file opens with a snapshot."""
    path = tmp_path / "l.jsonl"
    with EventLog(path, max_bytes=600) as log:
        _fill(log, 5)
        assert log.needs_rotation()
        log.rotate(make_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, {"projection": {}}))
        _fill(log, 2)
    files = segments(path)
    assert len(files) == 2 and files[-1] == path
    assert [e.seq for e in read_events(path)] == list(range(1, 9))
    assert next(read_events_file(files[-1])).kind is EventKind.SNAPSHOT


def test_pruned_segments_replay_from_snapshot(tmp_path: Path) -> None:
    """With keep=1 the oldest segments go, and reading starts at a snapshot."""
    path = tmp_path / "l.jsonl"
    with EventLog(path, max_bytes=300, keep=1) as log:
        for _ in range(3):
            _fill(log, 3)
            log.rotate(make_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, {"projection": {}}))
    assert len(segments(path)) == 2
    events = list(read_events(path))
    assert events[0].kind is EventKind.SNAPSHOT
    assert events[-1].seq == 12
