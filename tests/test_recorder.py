"""Tests of torpor.statemachine.machine.recorder: typed payloads become numbered events in the log, the projection and for subscribers."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.errors import ControllerClosed
from torpor.statemachine.core.events import EventKind, TagReleased, UsageObserved
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import read_events
from torpor.statemachine.machine.recorder import Recorder


def test_a_typed_payload_is_recorded_as_the_next_event_everywhere(tmp_path: Path) -> None:
    """record(payload): its kind from its class, the next number, in the log, the projection and to a subscriber."""
    recorder = Recorder("e", 0, EventLog(tmp_path / "e.jsonl", fsync=False), keep_events=10)
    seen = []
    recorder.subscribe(seen.append)
    recorder.record(UsageObserved(usage={"weights": 8}))
    event = recorder.record(TagReleased(tag="weights", bytes=8, action="offload"))
    assert (event.kind, event.seq, recorder.seq) == (EventKind.TAG_RELEASED, 2, 2)
    assert dict(event.data) == {"tag": "weights", "bytes": 8, "action": "offload"}  # optional fields not given: absent
    assert [e.seq for e in seen] == [1, 2] and recorder.events(after=1) == [event]
    assert [e.to_dict() for e in read_events(tmp_path / "e.jsonl")] == [e.to_dict() for e in seen]
    assert recorder.projection.last_seq == 2


def test_a_closed_recorder_refuses_to_record_and_closing_twice_does_nothing(tmp_path: Path) -> None:
    """close() records 'closed' and closes the log; a later record raises ControllerClosed naming the kind."""
    recorder = Recorder("e", 3, EventLog(tmp_path / "e.jsonl", fsync=False), keep_events=10)
    recorder.close()
    recorder.close()
    assert [e.kind for e in read_events(tmp_path / "e.jsonl")] == [EventKind.CLOSED]
    assert recorder.closed_at == 1
    with pytest.raises(ControllerClosed, match="usage_observed"):
        recorder.record(UsageObserved(usage={}))


def test_only_the_newest_events_are_kept_in_memory() -> None:
    """keep_events bounds events(); sequence numbers go on."""
    recorder = Recorder("e", 0, None, keep_events=2)
    for n in range(5):
        recorder.record(UsageObserved(usage={"weights": n}))
    assert [e.seq for e in recorder.events()] == [4, 5]
