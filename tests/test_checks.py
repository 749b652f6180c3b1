"""Tests for torpor.statemachine.log.checks: every event kind has a payload rule readers apply."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor import SleepController, TorporError
from torpor.statemachine.core.events import PAYLOADS, Event, EventKind
from torpor.statemachine.log import checks as payload
from torpor.statemachine.log.reader import read_events
from torpor.testing import FakeMemory


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


def test_every_field_the_controller_writes_is_declared_and_passes_its_check(tmp_path: Path) -> None:
    """Sleeps, wakes, rollbacks, refusals, discards, captures and hooks write only declared, well-typed fields."""
    memory = FakeMemory({"weights": 4096, "kv_cache": 8192, "cudagraph": 1024})
    ctl = SleepController(memory, log=tmp_path / "e.jsonl")
    ctl.sleep(1)
    ctl.wake(["weights"])
    ctl.wake()
    memory.fail_once("release", "kv_cache")  # a failed sleep rolls back: tag_restored(source=rollback), sleep_aborted
    with pytest.raises(TorporError):
        ctl.sleep(1)
    ctl.sleep(2)
    memory.fail_once("restore", "weights")  # a failed wake: tag_rolled_back, wake_failed
    with pytest.raises(TorporError):
        ctl.wake()
    with pytest.raises(TorporError):  # refused: asleep
        ctl.sleep(1)
    ctl.wake()
    ctl.sleep(1, idempotent=True)
    ctl.sleep(1, idempotent=True)  # command_repeated
    ctl.discard(["kv_cache"])
    ctl.wake()
    with ctl.capture("site"):
        pass
    memory.drop_graph("site")
    ctl.release_cudagraph_pool()
    ctl.observe()
    ctl.record(EventKind.HOOK_DECISION, hook="h", active=True, detail="d")
    ctl.close()
    events = list(read_events(tmp_path / "e.jsonl"))  # every reader checks each payload
    kinds = {e.kind for e in events}
    assert {EventKind.SLEEP_ABORTED, EventKind.WAKE_FAILED, EventKind.REFUSED, EventKind.COMMAND_REPEATED} <= kinds
    for event in events:
        undeclared = set(event.data) - set(type(event.data).fields)
        assert not undeclared, f"{event.kind.value} writes undeclared field(s) {sorted(undeclared)}"
        assert payload.payload_problem(event) is None
