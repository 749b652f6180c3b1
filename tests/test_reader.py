"""Tests for torpor.statemachine.log.reader: checksums, durability, torn lines, corruption, rotation, permissions."""

from __future__ import annotations

import json
import logging
import os
import stat
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import raw_event

import torpor.statemachine.log.codec as codec_module
import torpor.statemachine.log.reader as log_module
from torpor.errors import EventTooLarge, LogCorrupted, UnknownSchemaVersion
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import decode_line, encode_line, read_events, read_events_file, segments
from torpor.statemachine.projection.view import Projection

_EMPTY_PROJECTION = Projection().to_dict()  # what a snapshot of a fresh rank holds


def _fill(log: EventLog, n: int, kind: EventKind = EventKind.USAGE_OBSERVED) -> None:
    for _ in range(n):
        log.append(raw_event(kind, log.next_seq(), "e", 0, {"usage": {"weights": 1}}))


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
            log.append(raw_event(EventKind.OPENED, 5, "e", 0, {}))
    assert len(list(read_events(tmp_path / "l.jsonl"))) == 1


def test_torn_last_line_tolerated_with_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A partial last line is skipped with a warning, and cut before the next append."""
    path = tmp_path / "l.jsonl"
    with EventLog(path) as log:
        _fill(log, 2)
    with open(path, "ab") as fh:
        fh.write(encode_line(raw_event(EventKind.OPENED, 3, "e", 0, {}))[:20])
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
    event = raw_event(EventKind.OPENED, 1, "e", 0, {})
    object.__setattr__(event, "schema", 99)
    path.write_bytes(encode_line(event))
    with pytest.raises(UnknownSchemaVersion, match="99"):
        list(read_events(path))


def test_oversized_event_refused(tmp_path: Path) -> None:
    """An event over the line limit raises EventTooLarge and is not written."""
    with EventLog(tmp_path / "l.jsonl", max_line=512) as log:
        with pytest.raises(EventTooLarge, match="512"):
            log.append(raw_event(EventKind.USAGE_OBSERVED, 1, "e", 0, {"usage": {"x" * 600: 1}}))
        assert log.next_seq() == 1
    assert (tmp_path / "l.jsonl").read_bytes() == b""


def test_sequence_gap_is_corruption(tmp_path: Path) -> None:
    """A log whose sequence numbers skip raises LogCorrupted."""
    path = tmp_path / "l.jsonl"
    path.write_bytes(
        encode_line(raw_event(EventKind.OPENED, 1, "e", 0, {}))
        + encode_line(raw_event(EventKind.OPENED, 3, "e", 0, {}))
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
        log.rotate(raw_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, {"projection": _EMPTY_PROJECTION}))
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
            log.rotate(raw_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, {"projection": _EMPTY_PROJECTION}))
    assert len(segments(path)) == 2
    events = list(read_events(path))
    assert events[0].kind is EventKind.SNAPSHOT
    assert events[-1].seq == 12


# -- the fast path of read_events against decode_line (the reference) -------------------------

_PAYLOADS: list[tuple[EventKind, dict[str, Any]]] = [
    (EventKind.TAG_RELEASED, {"tag": "weights", "bytes": 2**34, "action": "offload", "seconds": 0.25}),
    (EventKind.SLEEP_REQUESTED, {"level": 1, "plan": {"weights": "offload"}, "usage": {"weights": 5, "kv": 0}}),
    (EventKind.WAKE_COMPLETED, {"tags": ["weights", "kv_cache"], "seconds": 1e-9, "extra": {"w": [1, {"x": 2}]}}),
    (EventKind.REFUSED, {"command": "sleep", "reason": 'busy \u00e9 "q" {[', "holders": []}),
    (EventKind.CLOSED, {}),
]


def _sign(rest: bytes) -> bytes:
    """A line whose checksum is right for ``rest`` (the text after the crc member)."""
    return b'{"crc":"%08x",' % zlib.crc32(rest, zlib.crc32(b"{")) + rest


def _outcome(fn: Any) -> tuple[str, Any]:
    """What fn() gives: ("ok", value) or ("error", (exception class, message))."""
    try:
        return "ok", fn()
    except (LogCorrupted, UnknownSchemaVersion) as exc:
        return "error", (type(exc), str(exc))


_MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 400), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 400), st.sampled_from([b" ", b"}", b"{", b'"', b",", b"\xff", b"NaN"])),
    st.tuples(st.just("delete"), st.integers(0, 400), st.integers(1, 8)),
    st.tuples(
        st.just("replace"),
        st.sampled_from([b'"schema":1', b'"seq":', b'"kind":"', b'"wall":', b'"data":{', b'"engine":"', b"}"]),
        st.sampled_from(
            [b'"schema":1.0', b'"schema":true', b'"schema":2', b'"seq":-', b'"kind":"x', b'"wall":"', b"", b"]"]
        ),
    ),
    st.tuples(st.just("append"), st.sampled_from([b" ", b"x", b"{}", b"\r"])),
)


def _mutate(rest: bytes, op: tuple[Any, ...]) -> bytes:
    if op[0] == "flip":
        i = op[1] % max(1, len(rest))
        return rest[:i] + bytes([rest[i] ^ op[2]]) + rest[i + 1 :] if rest else rest
    if op[0] == "insert":
        i, text = op[1] % (len(rest) + 1), bytes(op[2])
        return rest[:i] + text + rest[i:]
    if op[0] == "delete":
        i = op[1] % (len(rest) + 1)
        return rest[:i] + rest[i + op[2] :]
    if op[0] == "replace":
        return rest.replace(op[1], op[2], 1)
    return rest + bytes(op[1])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, len(_PAYLOADS) - 1),
    ops=st.lists(_MUTATIONS, max_size=3),
    resign=st.booleans(),
    max_line=st.sampled_from([log_module.DEFAULT_MAX_LINE, 200]),
)
def test_fast_path_gives_what_decode_line_gives(
    tmp_path: Path, which: int, ops: list[tuple[Any, ...]], resign: bool, max_line: int
) -> None:
    """For any line, well-formed or mutated, read_events_file gives decode_line's event or its exact error."""
    kind, data = _PAYLOADS[which]
    line = encode_line(Event(kind, 1, 1795996185.3145685, 8354.51769916, 4242, "e", 0, data))[:-1]
    rest = line[len(b'{"crc":"00000000",') :]
    for op in ops:
        rest = _mutate(rest, op)
    rest = rest.replace(b"\n", b"\\n")  # one line: a newline would end it
    line = _sign(rest) if resign else line[: len(b'{"crc":"00000000",')] + rest
    path = tmp_path / "one.jsonl"
    path.write_bytes(line + b"\n")
    expected = _outcome(lambda: decode_line(line, str(path), 1, max_line))
    got = _outcome(lambda: list(read_events_file(path, max_line)))
    if expected[0] == "ok":
        assert got == ("ok", [expected[1]])
        assert type(got[1][0]) is Event
    else:
        assert got == expected


def test_well_formed_lines_never_reach_decode_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clean log is read by the fast path alone; one bad line goes to decode_line, which names it."""
    path = tmp_path / "l.jsonl"
    with EventLog(path, fsync=False) as log:
        for kind, data in _PAYLOADS:
            log.append(raw_event(kind, log.next_seq(), "e", 0, data))
    calls: list[int] = []

    def counting(line: bytes, where: str, lineno: int, max_line: int = log_module.DEFAULT_MAX_LINE) -> Event:
        calls.append(lineno)
        return decode_line(line, where, lineno, max_line)

    monkeypatch.setattr(codec_module, "decode_line", counting)
    events = list(read_events(path))
    assert [e.kind for e in events] == [k for k, _ in _PAYLOADS] and calls == []
    lines = path.read_bytes().split(b"\n")
    lines[2] = _sign(lines[2][len(b'{"crc":"00000000",') :].replace(b'"schema":1', b'"schema":7'))
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(UnknownSchemaVersion, match=r"l\.jsonl:3"):
        list(read_events(path))
    assert calls == [3]


def test_read_events_equals_decode_line_over_a_whole_log(tmp_path: Path) -> None:
    """Every event read_events gives over a rotated log equals decode_line's for the same line."""
    path = tmp_path / "l.jsonl"
    with EventLog(path, fsync=False, max_bytes=2000) as log:
        for i in range(60):
            kind, data = _PAYLOADS[i % len(_PAYLOADS)]
            log.append(raw_event(kind, log.next_seq(), "e", 0, data))
            if log.needs_rotation():
                log.rotate(raw_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, {"projection": _EMPTY_PROJECTION}))
    reference = [
        decode_line(line, str(file), n)
        for file in segments(path)
        for n, line in enumerate(file.read_bytes().split(b"\n")[:-1], 1)
    ]
    assert len(segments(path)) > 2
    assert list(read_events(path)) == reference


_GOOD_REST = (
    b'"data":{"tag":"w"},"engine":"e","kind":"tag_released","mono":1.5,"pid":7,"rank":0,"schema":1,"seq":1,"wall":2.5}'
)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b"", b""),
        (b'"schema":1', b'"schema":1.0'),
        (b'"schema":1', b'"schema":true'),
        (b'"schema":1', b'"schema":"1"'),
        (b'"schema":1', b'"schema":2'),
        (b'"schema":1,', b""),
        (b"2.5}", b"2.5} "),
        (b"2.5}", b"2.5}{}"),
        (b'{"tag":"w"}', b"[1]"),
        (b'"kind":"tag_released"', b'"kind":"exploded"'),
        (b'"kind":"tag_released"', b'"kind":["tag_released"]'),
        (b'"wall":2.5', b'"wall":NaN'),
        (b'"wall":2.5', b'"wall":2'),
        (b'"seq":1', b'"seq":1.0'),
        (b'"seq":1,', b""),
        (b'"engine":"e"', b'"engine":"\xff"'),
        (b'"engine":"e"', b'"engine":"\\u00e9"'),
        (b'"data":{"tag":"w"},', b'"data":{"tag":"w","tag":"v"},'),
        (b'"data":{"tag":"w"},', b'"data":{"a":{"b":[1,[2]]}},'),
        (b'"rank":0', b'"rank":0,"rank":1'),
    ],
)
def test_fast_path_edge_lines(tmp_path: Path, old: bytes, new: bytes) -> None:
    """Lines at each check of decode_line give the same event or error through read_events_file."""
    line = _sign(_GOOD_REST.replace(old, new, 1))
    path = tmp_path / "one.jsonl"
    for candidate in (line, line.upper()[:18] + line[18:], line[:18], line[:8] + b"+" + line[9:]):
        path.write_bytes(candidate + b"\n")
        expected = _outcome(lambda: decode_line(candidate, str(path), 1))  # noqa: B023 - called at once
        got = _outcome(lambda: list(read_events_file(path)))
        assert got == (("ok", [expected[1]]) if expected[0] == "ok" else expected)
