"""Tests for torpor.statemachine.events: immutability and the log form."""

from __future__ import annotations

import dataclasses

import pytest

from torpor.statemachine.events import SCHEMA_VERSION, Event, EventKind, make_event


def test_event_is_frozen() -> None:
    """An event's fields and payload cannot be changed after it is made."""
    event = make_event(EventKind.SLEEP_REQUESTED, 1, "e", 0, {"level": 1, "plan": {"weights": "offload"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.seq = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        event.data["level"] = 2  # type: ignore[index]
    with pytest.raises(TypeError):
        event.data["plan"]["weights"] = "discard"


def test_event_round_trips_through_dict() -> None:
    """to_dict then from_dict gives an equal event, schema version included."""
    event = make_event(EventKind.TAG_RELEASED, 7, "eng", 3, {"tag": "weights", "bytes": 10, "action": "offload"})
    again = Event.from_dict(event.to_dict())
    assert again == event
    assert again.schema == SCHEMA_VERSION
    assert again.pid == event.pid and again.rank == 3


def test_unknown_kind_is_rejected() -> None:
    """from_dict refuses a kind this torpor does not know, naming it."""
    raw = make_event(EventKind.OPENED, 1, "e", 0, {}).to_dict()
    raw["kind"] = "exploded"
    with pytest.raises(ValueError, match="exploded"):
        Event.from_dict(raw)


def test_bad_field_type_is_rejected() -> None:
    """from_dict names a field of the wrong type."""
    raw = make_event(EventKind.OPENED, 1, "e", 0, {}).to_dict()
    raw["seq"] = "one"
    with pytest.raises(ValueError, match="seq"):
        Event.from_dict(raw)
