"""Tests for torpor.statemachine.core.events: immutability and the log form."""

from __future__ import annotations

import dataclasses
import json
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import pytest
from support import raw_event

from torpor.errors import LogCorrupted
from torpor.statemachine.core.events import PAYLOADS, SCHEMA_VERSION, Event, EventKind
from torpor.statemachine.core.fields import REQUIRED
from torpor.statemachine.log.codec import decode_line, decode_lines, encode_line


def test_event_is_frozen() -> None:
    """An event's fields and payload cannot be changed after it is made."""
    event = raw_event(EventKind.SLEEP_REQUESTED, 1, "e", 0, {"level": 1, "plan": {"weights": "offload"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.seq = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        event.data["level"] = 2  # type: ignore[index]
    with pytest.raises(TypeError):
        event.data["plan"]["weights"] = "discard"


def test_event_round_trips_through_dict() -> None:
    """to_dict then from_dict gives an equal event, schema version included."""
    event = raw_event(EventKind.TAG_RELEASED, 7, "eng", 3, {"tag": "weights", "bytes": 10, "action": "offload"})
    again = Event.from_dict(event.to_dict())
    assert again == event
    assert again.schema == SCHEMA_VERSION
    assert again.pid == event.pid and again.rank == 3


def test_unknown_kind_is_rejected() -> None:
    """from_dict refuses a kind this torpor does not know, naming it."""
    raw = raw_event(EventKind.OPENED, 1, "e", 0, {}).to_dict()
    raw["kind"] = "exploded"
    with pytest.raises(ValueError, match="exploded"):
        Event.from_dict(raw)


def test_bad_field_type_is_rejected() -> None:
    """from_dict names a field of the wrong type."""
    raw = raw_event(EventKind.OPENED, 1, "e", 0, {}).to_dict()
    raw["seq"] = "one"
    with pytest.raises(ValueError, match="seq"):
        Event.from_dict(raw)


def test_parsed_event_is_an_ordinary_frozen_event() -> None:
    """An event built from its log form is of class Event, equal to the original, and frozen."""
    event = raw_event(EventKind.SLEEP_REQUESTED, 3, "e", 1, {"level": 1, "usage": {"weights": 5}, "tags": ["a"]})
    again = Event.from_dict(event.to_dict())
    assert type(again) is Event
    assert again == event
    assert again.data["usage"] == {"weights": 5} and again.data["tags"] == ("a",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.kind = EventKind.CLOSED  # type: ignore[misc]
    assert dataclasses.replace(again, seq=4).seq == 4


def test_from_dict_does_not_share_the_callers_objects() -> None:
    """from_dict copies nested objects: changing the caller's dict afterwards leaves the event as it was."""
    raw = raw_event(EventKind.OPENED, 1, "e", 0, {"usage": {"weights": 5}, "tags": ["a"]}).to_dict()
    event = Event.from_dict(raw)
    raw["data"]["usage"]["weights"] = 6
    raw["data"]["tags"].append("b")
    assert event.data["usage"]["weights"] == 5 and event.data["tags"] == ("a",)
    assert type(raw["data"]["usage"]) is dict  # the caller's dict is not frozen in place either


def test_missing_data_is_an_empty_payload() -> None:
    """A log form without "data" gives an empty, read-only payload."""
    raw = raw_event(EventKind.CLOSED, 1, "e", 0, {}).to_dict()
    del raw["data"]
    event = Event.from_dict(raw)
    assert dict(event.data) == {}
    with pytest.raises(TypeError):
        event.data["x"] = 1  # type: ignore[index]


def test_data_that_is_not_an_object_is_rejected() -> None:
    """from_dict names the type of a payload that is not a JSON object."""
    raw = raw_event(EventKind.OPENED, 1, "e", 0, {}).to_dict()
    raw["data"] = [1]
    with pytest.raises(ValueError, match="'data' must be an object, got list"):
        Event.from_dict(raw)


def test_plain_and_other_log_forms_build_the_same_event() -> None:
    """The codec's fast path builds what decode_line builds for the plain form; other forms go to decode_line."""
    event = raw_event(EventKind.WAKE_COMPLETED, 9, "e", 2, {"tags": ["w"], "usage": {"w": 1}, "seconds": 0.5})
    line = encode_line(event)[:-1]
    fast = next(decode_lines([line], "p"))
    assert fast == decode_line(line, "p", 1) == Event.from_dict(json.loads(event.to_json())) == event
    assert type(fast) is Event
    for name, value in (("wall", 2), ("seq", 1.0), ("pid", True), ("engine", 3), ("rank", None), ("data", [])):
        raw = json.loads(event.to_json())
        raw[name] = value
        body = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
        signed = b'{"crc":"%08x",' % zlib.crc32(body) + body[1:]
        try:
            expected: object = decode_line(signed, "p", 1)
        except LogCorrupted as exc:
            expected = str(exc)
        try:
            got: object = next(decode_lines([signed], "p"))
        except LogCorrupted as exc:
            got = str(exc)
        assert got == expected
    with pytest.raises(ValueError, match="exploded"):
        Event.from_dict({**json.loads(event.to_json()), "kind": "exploded"})


DOC = Path(__file__).resolve().parent.parent / "docs" / "statemachine.md"
BEGIN, END = "<!-- payload-table-begin (generated by python tests/test_events.py) -->", "<!-- payload-table-end -->"


def _type_text(hint: Any) -> str:
    if get_origin(hint) is Annotated:
        hint = get_args(hint)[0]
    text = str(hint) if get_args(hint) else getattr(hint, "__name__", str(hint))
    return text.replace("typing.", "").replace("collections.abc.", "").replace("NoneType", "None").replace("|", "\\|")


def _default_text(default: Any) -> str:
    return " = `{}`" if isinstance(default, Mapping) else f" = `{default!r}`"


def payload_table() -> str:
    """The Markdown table of every kind's payload fields, from the classes."""
    rows = ["| kind | class | fields (`name: type`, `= default` when optional) |", "| --- | --- | --- |"]
    for kind in EventKind:
        cls = PAYLOADS[kind]
        fields = [
            f"`{f.name}: {_type_text(f.type)}`" + ("" if f.default is REQUIRED else _default_text(f.default))
            for f in cls.fields.values()
        ]
        rows.append(f"| `{kind.value}` | `{cls.__name__}` | {', '.join(fields) or '(none)'} |")
    return "\n".join(rows)


def rendered_doc(text: str) -> str:
    """``text`` with the payload table between its markers replaced by a fresh one."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{payload_table()}\n{END}{tail}"


def test_docs_list_every_payload_field() -> None:
    """docs/statemachine.md's payload table is the one the classes generate."""
    text = DOC.read_text()
    assert text == rendered_doc(text), "docs/statemachine.md is stale: run python tests/test_events.py"


if __name__ == "__main__":
    DOC.write_text(rendered_doc(DOC.read_text()))
    sys.stdout.write(f"wrote {DOC.relative_to(DOC.parent.parent)}\n")
