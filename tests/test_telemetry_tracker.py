"""Tests for torpor.telemetry.tracker: events folded into observations, once each, from attach on."""

from __future__ import annotations

from typing import Any

import pytest
from support import raw_event

from torpor import EventKind, SleepController, State
from torpor.errors import InvalidTransition
from torpor.telemetry.tracker import HOST_TO_DEVICE, Observation, Tracker, interpret, woken_label
from torpor.testing import FakeMemory

TAGS = {"weights": 4000, "kv_cache": 8000, "cudagraph": 300, "runtime": 50}


class Recorder:
    """A sink that keeps every (event kind, observations) it is handed."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, list[Observation]]] = []

    def handle(self, tracker: Tracker, event: Any, observations: list[Observation]) -> None:
        self.seen.append((event.seq, event.kind.value, observations))

    def metric(self, name: str) -> list[Observation]:
        return [o for _, _, obs in self.seen for o in obs if o.metric == name]


def test_woken_label_is_all_or_sorted_tags() -> None:
    """A wake's tags label is 'all' for None and the sorted, comma-joined names otherwise."""
    assert woken_label(None) == "all"
    assert woken_label(["weights", "kv_cache"]) == "kv_cache,weights"


def test_interpret_counts_a_transition_only_when_the_state_changes() -> None:
    """A state change yields one transition observation; an event that keeps the state yields none."""
    event = raw_event(EventKind.WAKE_REQUESTED, 5, "e", 0, {"tags": None, "restoring": []})
    changed = list(interpret(event, State.ASLEEP_L1, State.RESUMING))
    same = list(interpret(event, State.AWAKE, State.AWAKE))
    assert Observation("transition", ("asleep_l1", "resuming"), 1.0) in changed
    assert not [o for o in same if o.metric == "transition"]


def test_interpret_restore_from_host_is_a_transfer_but_fresh_is_not() -> None:
    """A tag restored from the host counts bytes and seconds host_to_device; one mapped fresh counts none."""
    host = raw_event(EventKind.TAG_RESTORED, 7, "e", 0, {"tag": "w", "bytes": 10, "source": "host", "seconds": 0.5})
    fresh = raw_event(EventKind.TAG_RESTORED, 8, "e", 0, {"tag": "k", "bytes": 10, "source": "fresh", "seconds": 0.1})
    got = list(interpret(host, State.RESUMING, State.RESUMING))
    assert Observation("transfer_bytes", ("w", HOST_TO_DEVICE), 10.0) in got
    assert Observation("transfer_seconds", ("w", HOST_TO_DEVICE), 0.5) in got
    assert not [o for o in interpret(fresh, State.RESUMING, State.RESUMING) if o.metric.startswith("transfer")]


def test_tracker_feeds_each_event_once_from_attach_on() -> None:
    """Events before attach are not counted; each later event reaches the sink once, in order."""
    controller = SleepController(FakeMemory(TAGS), engine="e", rank=3)
    controller.sleep(1)
    first_seq = controller.last_seq
    recorder = Recorder()
    tracker = Tracker(controller, [recorder])
    controller.wake()
    seqs = [seq for seq, _, _ in recorder.seen]
    assert seqs == list(range(first_seq + 1, controller.last_seq + 1))
    assert tracker.engine == "e"
    assert tracker.rank == 3
    assert tracker.driver == "FakeMemory"
    assert [o.labels for o in recorder.metric("wake_seconds")] == [("all",)]


def test_tracker_records_refusals_by_error_class() -> None:
    """A refused command becomes a refusal observation labelled with the command and the error class."""
    controller = SleepController(FakeMemory(TAGS))
    recorder = Recorder()
    Tracker(controller, [recorder])
    with pytest.raises(InvalidTransition):
        controller.wake()
    assert [o.labels for o in recorder.metric("refusal")] == [("wake", "InvalidTransition")]


def test_a_failing_sink_breaks_neither_the_controller_nor_other_sinks() -> None:
    """A sink that raises is logged; the command succeeds and the other sinks still see the event."""

    class Broken:
        def handle(self, tracker: Tracker, event: Any, observations: list[Observation]) -> None:
            raise RuntimeError("boom")

    controller = SleepController(FakeMemory(TAGS))
    recorder = Recorder()
    Tracker(controller, [Broken(), recorder])
    controller.sleep(1)
    assert controller.state is State.ASLEEP_L1
    assert recorder.metric("sleep_seconds")


def test_close_unsubscribes() -> None:
    """After close the tracker sees no more events."""
    controller = SleepController(FakeMemory(TAGS))
    recorder = Recorder()
    tracker = Tracker(controller, [recorder])
    tracker.close()
    controller.sleep(1)
    assert recorder.seen == []
