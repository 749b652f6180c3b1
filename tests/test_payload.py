"""Tests for torpor.statemachine.payload: every event kind has a payload rule readers apply."""

from __future__ import annotations

from torpor.statemachine import payload
from torpor.statemachine.events import PAYLOADS, Event, EventKind


def test_every_event_kind_has_a_payload_rule() -> None:
    """A kind added without a rule would make every reader fail with KeyError: each kind has one, from its class."""
    assert set(payload._CHECKS) == set(PAYLOADS) == set(EventKind)
    for kind, cls in PAYLOADS.items():
        assert set(payload._CHECKS[kind]) == set(cls.fields)


def test_a_group_outcome_missing_its_result_is_named() -> None:
    """A group_agreed line without its result is refused by name, a whole one passes."""
    base = {"group": "tp", "command": "wake", "round": 3, "size": 2}
    whole = Event(
        seq=5,
        wall=1.0,
        mono=1.0,
        pid=1,
        engine="e",
        rank=0,
        kind=EventKind.GROUP_AGREED,
        data={**base, "result": "commit", "failed": {}},
    )
    torn = Event(seq=6, wall=1.0, mono=1.0, pid=1, engine="e", rank=0, kind=EventKind.GROUP_AGREED, data=base)
    assert payload.payload_problem(whole) is None
    assert payload.payload_problem(torn) == "event #6 (group_agreed) lacks its 'result' field"
