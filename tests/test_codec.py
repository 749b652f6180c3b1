"""Tests for torpor.statemachine.codec: the log's on-disk form, read and written in one place."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from torpor.errors import LogCorrupted
from torpor.statemachine import codec
from torpor.statemachine.codec import decode_line, decode_lines, encode_line
from torpor.statemachine.events import PAYLOADS, Event, EventKind, make_event, thaw

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
    event = make_event(EventKind.TAG_RESTORED, 1, "e", 0, {"tag": "w", "bytes": 1, "lost": "yes"})
    with pytest.raises(LogCorrupted, match=r"f\.jsonl:4: .*'lost' must be true or false"):
        list(decode_lines([encode_line(event)[:-1]], "f.jsonl", 3))


def test_the_codec_uses_no_private_json_api() -> None:
    """The codec calls json's documented API only (raw_decode), never the scanner behind it."""
    tree = ast.parse(Path(codec.__file__).read_text())
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert "scan_once" not in names and "raw_decode" in names


def test_encode_then_decode_is_the_same_event() -> None:
    """Every kind's event survives encode_line then decode_line unchanged, and is an Event."""
    event = make_event(
        EventKind.GROUP_AGREED,
        4,
        "e",
        1,
        {"group": "tp", "command": "wake", "round": 2, "size": 2, "result": "commit", "failed": {}, "voted": True},
    )
    again = decode_line(encode_line(event), "p", 1)
    assert again == event and type(again) is Event and again.data.result == "commit"
