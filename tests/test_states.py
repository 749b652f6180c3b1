"""Tests for torpor.statemachine.core.states: the table, the guard built from it, its conditions and the committed diagram."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import off_table_moves, raw_event

from torpor import SleepController
from torpor.errors import InvalidTransition, NotRecovered, PoolBusy, TorporError
from torpor.statemachine.core import states
from torpor.statemachine.core.events import EventKind, SleepRequested
from torpor.statemachine.core.states import (
    COMMANDS,
    GUARD,
    TRANSITIONAL,
    TRANSITIONS,
    State,
    allowed_sources,
    decide,
    destination,
    diagram_markdown,
    mermaid,
)
from torpor.statemachine.log.eventlog import EventLog
from torpor.testing import FakeMemory

ROOT = Path(__file__).resolve().parent.parent


def test_every_state_reachable_in_table() -> None:
    """Every state appears as a destination or is the initial state."""
    dests = {row["dest"] for row in TRANSITIONS if row["dest"]}
    assert {s.value for s in State} - dests == {State.AWAKE.value} - dests


def test_allowed_sources_for_wake() -> None:
    """Wake is allowed from both asleep states and partially_awake only."""
    assert set(allowed_sources("wake")) == {"asleep_l1", "asleep_l2", "partially_awake"}


def test_capture_only_while_awake() -> None:
    """Capturing into the graph pool is allowed only while awake."""
    assert allowed_sources("capture") == ("awake",)


def test_every_command_is_a_trigger() -> None:
    """Each public command has at least one row in the table."""
    for command in COMMANDS:
        assert allowed_sources(command), command


def test_mermaid_lists_every_row() -> None:
    """The diagram has one edge per (row, source) pair of the table."""
    edges = [line for line in mermaid().splitlines() if "-->" in line and "[*]" not in line and "closed" not in line]
    expected = sum(len(r["source"]) if isinstance(r["source"], list) else 1 for r in TRANSITIONS)
    assert len(edges) == expected


def test_the_diagram_has_the_closed_state_every_reader_names() -> None:
    """close() leads from every settled state to 'closed' (as torpor status and /state say), and 'opened' back."""
    lines = mermaid().splitlines()
    settled = [s.value for s in State if s not in TRANSITIONAL]
    assert all(f"    {s} --> closed: close()" in lines for s in settled)
    assert not [line for line in lines if line.startswith(tuple(f"    {s.value} --> closed" for s in TRANSITIONAL))]
    assert any(line.startswith("    closed --> awake: opened") for line in lines)


def test_committed_diagram_is_current() -> None:
    """docs/state-diagram.md equals what `torpor diagram --markdown` generates."""
    assert (ROOT / "docs" / "state-diagram.md").read_text() == diagram_markdown()


def test_guard_has_a_verdict_for_every_state_and_command() -> None:
    """GUARD holds one verdict per state and command, and decide() returns it."""
    assert set(GUARD) == {(s, c) for s in State for c in COMMANDS}
    for (state, command), verdict in GUARD.items():
        assert decide(state, command) is verdict
        assert (verdict.state, verdict.command) == (state, command)


def test_verdicts_agree_with_the_transition_rows() -> None:
    """A command is accepted exactly from its rows' sources, and leads to their destinations."""
    for (state, command), verdict in GUARD.items():
        rows = [r for r in TRANSITIONS if r["trigger"] == command]
        sources = [s for r in rows for s in (r["source"] if isinstance(r["source"], list) else [r["source"]])]
        assert verdict.accepted == (state.value in sources), (state, command)
        assert verdict.allowed == allowed_sources(command)
        if verdict.accepted:
            assert verdict.error is None and verdict.dests
        else:
            assert verdict.error is not None and verdict.dests == ()


def test_interrupted_log_accepts_only_recover() -> None:
    """In suspending or resuming every command but recover is refused with NotRecovered."""
    for state in TRANSITIONAL:
        for command in COMMANDS:
            verdict = decide(state, command)
            if command == "recover":
                assert verdict.accepted and set(verdict.dests) == {State.AWAKE, State.PARTIALLY_AWAKE}
            else:
                assert verdict.error is NotRecovered, (state, command)


def test_release_pool_while_asleep_is_pool_busy() -> None:
    """The table refuses release_pool while asleep with PoolBusy, and a plain InvalidTransition elsewhere."""
    for state in (State.ASLEEP_L1, State.ASLEEP_L2):
        verdict = decide(state, "release_pool")
        assert verdict.error is PoolBusy and "asleep" in verdict.reason
    assert decide(State.ASLEEP_L1, "capture").error is InvalidTransition
    assert decide(State.AWAKE, "wake").error is InvalidTransition


def test_decide_names_the_commands_for_an_unknown_one() -> None:
    """decide() of a name that is no command raises ValueError listing the commands."""
    with pytest.raises(ValueError, match="'finish_sleep' is not a command; the commands are sleep, wake"):
        decide(State.SUSPENDING, "finish_sleep")


def test_a_refusal_that_contradicts_the_rows_fails_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A REFUSALS entry for a cell the rows accept is a table error, found when the guard is built."""
    monkeypatch.setattr(states, "REFUSALS", {(State.AWAKE, "sleep"): (PoolBusy, "why")})
    with pytest.raises(ValueError, match="accepts sleep from awake"):
        states._verdict(State.AWAKE, "sleep")


def test_destination_evaluates_the_conditions() -> None:
    """destination() picks the row whose condition holds on the projection's facts."""

    class Facts:
        def __init__(self, level: int | None, resume_from: State | None, asleep: list[str]) -> None:
            self.level, self.resume_from, self._asleep = level, resume_from, asleep

        def asleep_tags(self) -> list[str]:
            return self._asleep

    assert destination(State.SUSPENDING, "finish_sleep", Facts(2, State.AWAKE, ["w"])) is State.ASLEEP_L2
    assert destination(State.SUSPENDING, "abort_sleep", Facts(1, State.PARTIALLY_AWAKE, [])) is State.PARTIALLY_AWAKE
    assert destination(State.RESUMING, "finish_wake", Facts(None, State.ASLEEP_L1, ["kv"])) is State.PARTIALLY_AWAKE
    assert destination(State.RESUMING, "finish_wake", Facts(None, State.ASLEEP_L1, [])) is State.AWAKE
    assert destination(State.ASLEEP_L1, "discard", Facts(1, State.AWAKE, ["w"])) is State.ASLEEP_L1
    assert destination(State.AWAKE, "wake", Facts(None, None, [])) is None


def test_every_state_change_follows_the_table() -> None:
    """Sleeps, wakes, discards, aborted sleeps, failed wakes and a recovery move the state only along the table."""
    memory = FakeMemory({"weights": 4096, "kv_cache": 8192, "cudagraph": 1024, "runtime": 512})
    ctl = SleepController(memory)
    ctl.sleep(1)
    ctl.wake(["weights"])  # partially_awake: kv_cache stays asleep
    ctl.discard(["kv_cache"])
    ctl.wake()
    ctl.discard(["kv_cache"])  # awake -> partially_awake
    for op, tag, level in (("release", "weights", 1), ("backup", "*", 2)):
        memory.fail_once(op, tag)
        with pytest.raises(TorporError):
            ctl.sleep(level)  # aborted: back to partially_awake
    ctl.sleep(2)
    memory.fail_once("restore", "runtime")
    with pytest.raises(TorporError):
        ctl.wake()  # failed: back to asleep_l2
    ctl.wake()
    assert ctl.state is State.AWAKE
    kinds = {e.kind.value for e in ctl.events()}
    assert {"sleep_aborted", "wake_failed", "discard_completed", "wake_completed"} <= kinds
    assert off_table_moves(ctl.events()) == []


def test_a_recovery_follows_the_table(tmp_path: Path) -> None:
    """A log left in suspending, then recover(), moves only along the table."""
    log = EventLog(tmp_path / "e.jsonl", fsync=False)
    ctl = SleepController(FakeMemory({"weights": 4096}), log=log)
    ctl._recorder.record(SleepRequested(level=1, plan={"weights": "offload"}, usage={"weights": 4096}))
    ctl.recover()
    assert ctl.state is State.AWAKE
    assert off_table_moves(ctl.events()) == []


def test_off_table_moves_catches_a_move_the_table_lacks() -> None:
    """The checker is not vacuous: a wake_completed straight from awake to partially_awake is reported."""
    ctl = SleepController(FakeMemory({"weights": 4096}))
    opened = ctl.events()[0]
    wrong = raw_event(EventKind.DISCARD_COMPLETED, 2, "default", 0, {"tags": []})
    released = raw_event(EventKind.TAG_RELEASED, 2, "default", 0, {"tag": "weights", "bytes": 1, "action": "discard"})
    moved = raw_event(EventKind.WAKE_COMPLETED, 3, "default", 0, {"tags": None, "seconds": 0.0, "restored": 0})
    assert off_table_moves([opened, wrong]) == []
    assert off_table_moves([opened, released, moved]) == [
        "#3 wake_completed: awake -> partially_awake, the table says None"
    ]


def test_the_transitions_package_is_not_used() -> None:
    """Running commands imports no ``transitions`` package: the table is the only state model (not a dependency)."""
    code = (
        "import sys, torpor; from torpor.testing import FakeMemory; "
        "c = torpor.SleepController(FakeMemory({'weights': 1})); c.sleep(1); c.wake(); "
        "print(sorted(m for m in sys.modules if m == 'transitions' or m.startswith('transitions.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"transitions' not in pyproject
