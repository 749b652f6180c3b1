"""Tests for torpor.statemachine.log.codec: the log's on-disk form, read and written in one place."""

from __future__ import annotations

import ast
import json
import zlib
from pathlib import Path

import pytest
from support import raw_event

from torpor.errors import LogCorrupted
from torpor.statemachine.core.events import PAYLOADS, Event, EventKind, thaw
from torpor.statemachine.log import codec
from torpor.statemachine.log.codec import decode_line, decode_lines, encode_line
from torpor.statemachine.projection.view import Projection

#: One line of each kind a controller writes, as torpor 39a9702 (before the typed payloads) wrote them.
OLD_LOG = Path(__file__).parent / "data" / "main-39a9702.jsonl"


def test_old_lines_read_and_write_back_byte_for_byte() -> None:
    """Lines written before the typed payloads decode to their classes and encode to the same bytes."""
    lines = OLD_LOG.read_bytes().splitlines()
    events = list(decode_lines(lines, str(OLD_LOG)))
    assert len(events) == len(lines) >= 10
    for line, event in zip(lines, events, strict=True):
        assert type(event.data) is PAYLOADS[event.kind]
        assert encode_line(event) == line + b"\n"
        assert decode_line(line, str(OLD_LOG), 1) == event


def test_typed_fields_read_what_the_old_lines_hold() -> None:
    """The typed attributes of decoded old lines give the values their JSON holds, defaults where absent."""
    for line in OLD_LOG.read_bytes().splitlines():
        event = decode_line(line, str(OLD_LOG), 1)
        raw = json.loads(line)["data"]
        for name, field in type(event.data).fields.items():
            value = getattr(event.data, name)
            if name in raw:
                assert thaw(value) == raw[name]
            else:
                assert value == field.default


def test_a_field_of_the_wrong_type_is_named_with_file_and_line() -> None:
    """A checksummed line whose declared field has the wrong type raises LogCorrupted naming it."""
    event = raw_event(EventKind.TAG_RESTORED, 1, "e", 0, {"tag": "w", "bytes": 1, "lost": "yes"})
    with pytest.raises(LogCorrupted, match=r"f\.jsonl:4: .*'lost' must be true or false"):
        list(decode_lines([encode_line(event)[:-1]], "f.jsonl", 3))


def test_the_codec_uses_no_private_json_api() -> None:
    """The codec calls json's documented API only (raw_decode), never the scanner behind it."""
    tree = ast.parse(Path(codec.__file__).read_text())
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert "scan_once" not in names and "raw_decode" in names


def test_encode_then_decode_is_the_same_event() -> None:
    """Every kind's event survives encode_line then decode_line unchanged, and is an Event."""
    event = raw_event(
        EventKind.GROUP_AGREED,
        4,
        "e",
        1,
        {"group": "tp", "command": "wake", "round": 2, "size": 2, "result": "commit", "failed": {}, "voted": True},
    )
    again = decode_line(encode_line(event), "p", 1)
    assert again == event and type(again) is Event and again.data.result == "commit"


#: Values of every shape a payload field may meet in a hand-edited or foreign log line.
_ODD_VALUES: tuple[object, ...] = (
    None,
    True,
    False,
    0,
    1,
    -1,
    2**63 - 1,
    2**63,
    0.5,
    -0.5,
    float("inf"),
    float("nan"),
    "weights",
    "",
    [],
    ["weights", "kv_cache"],
    ["weights", 1],
    {},
    {"weights": 1},
    {"weights": -1},
    {"weights": "x"},
    {"weights": {"host": 1, "discarded": 0}},
    {"total": -5, "in_use": 3},
)


def _valid_payload(kind: EventKind) -> dict[str, object]:
    """A payload of ``kind`` the reference check accepts, built from values of the list above."""
    from torpor.statemachine.log.checks import _CHECKS

    out: dict[str, object] = {}
    for name, check in _CHECKS[kind].items():
        field = PAYLOADS[kind].fields[name]
        if not field.required:
            continue
        candidates = (*_ODD_VALUES, Projection().to_dict())  # a snapshot's projection
        out[name] = next(v for v in candidates if check(v) is None)
    return out


def test_the_fast_check_agrees_with_payload_problem_on_every_field() -> None:
    """The codec's per-kind fast check accepts a payload exactly when payload_problem finds nothing."""
    from torpor.statemachine.log.checks import payload_problem

    compared = 0
    for name, (kind, required, rules) in codec._FAST.items():
        base = _valid_payload(kind)
        assert payload_problem(Event(kind, 7, 1.0, 2.0, 3, "e", 0, base)) is None, (name, base)
        cases: list[dict[str, object]] = [base, {}]
        for field in PAYLOADS[kind].fields:
            for value in _ODD_VALUES:
                cases.append({**base, field: value})
            cases.append({k: v for k, v in base.items() if k != field})  # the field missing
        cases.append({**base, "not_declared": {"nested": [1, 2]}})  # undeclared fields are free
        for data in cases:
            event = Event(kind, 7, 1.0, 2.0, 3, "e", 0, data)
            ok = codec._payload_ok(data, required, rules)
            assert ok == (payload_problem(event) is None), (name, data, payload_problem(event))
            compared += 1
    assert compared > 500


def test_a_bad_envelope_on_the_fast_path_is_refused_like_decode_line() -> None:
    """A line whose sequence number, pid, rank or time is out of range gets decode_line's error, not an event."""
    good = json.loads(encode_line(raw_event(EventKind.OPENED, 1, "e", 0, {}))[:-1])
    for field, value in (("seq", -1), ("pid", 2**63), ("rank", -2), ("wall", float("inf")), ("mono", float("nan"))):
        raw = {k: v for k, v in good.items() if k != "crc"}
        raw[field] = value
        body = json.dumps(raw, sort_keys=True, separators=(",", ":"))
        crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
        line = f'{{"crc":"{crc:08x}",{body[1:]}'.encode()
        with pytest.raises(LogCorrupted):
            list(decode_lines([line], "x.jsonl"))
        with pytest.raises(LogCorrupted):
            decode_line(line, "x.jsonl", 1)


def _signed(raw: dict[str, object]) -> bytes:
    """A log line of ``raw`` (without "crc") with a correct checksum, as a writer would make it."""
    body = json.dumps({k: v for k, v in raw.items() if k != "crc"}, sort_keys=True, separators=(",", ":"))
    crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
    return f'{{"crc":"{crc:08x}",{body[1:]}'.encode()


@pytest.mark.parametrize("wall", [1e20, -1.0, 253402300800.0, 1.7976931348623157e308])
def test_a_wall_time_no_clock_can_show_is_corruption(wall: float) -> None:
    """A checksummed line whose wall time is finite but outside 1970..9999 is LogCorrupted naming it, on both paths."""
    raw = json.loads(encode_line(raw_event(EventKind.OPENED, 1, "e", 0, {}))[:-1])
    raw["wall"] = wall
    line = _signed(raw)
    with pytest.raises(LogCorrupted, match="wall"):
        list(decode_lines([line], "x.jsonl"))
    with pytest.raises(LogCorrupted, match="wall"):
        decode_line(line, "x.jsonl", 1)
    raw["wall"] = 253402214400.0  # the last accepted second: it prints (time.localtime, datetime)
    assert decode_line(_signed(raw), "x.jsonl", 1).wall == 253402214400.0


def test_a_snapshot_whose_state_began_at_no_date_is_corruption() -> None:
    """A snapshot whose projection's since_wall is finite but no date (1e20) is LogCorrupted naming it, on both paths."""
    projection = Projection().to_dict()
    projection["since_wall"] = 1e20
    line = encode_line(raw_event(EventKind.SNAPSHOT, 1, "e", 0, {"projection": projection}))[:-1]
    with pytest.raises(LogCorrupted, match="since_wall"):
        list(decode_lines([line], "x.jsonl"))
    with pytest.raises(LogCorrupted, match="since_wall"):
        decode_line(line, "x.jsonl", 1)
