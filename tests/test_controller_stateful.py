"""Hypothesis stateful test: random commands, failures and reopenings never break the controller's invariants."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import off_table_moves

from torpor import SleepController, State, replay
from torpor.errors import TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.log.eventlog import EventLog
from torpor.testing import FakeMemory

SIZES = {"weights": 4096, "kv_cache": 8192, "cudagraph": 1024, "runtime": 512}
TAGS = [*SIZES, "bogus"]
OPERATIONS = ["backup", "release", "restore", "drop_backup"]


class ControllerMachine(RuleBasedStateMachine):
    """Drives a controller over FakeMemory and checks replay, refusals and residency after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="torpor-stateful-"))
        self.memory = FakeMemory(SIZES)
        self.ctl = SleepController(self.memory, log=EventLog(self.dir / "e.jsonl", fsync=False, max_bytes=8000))
        self.expected = {t: self.memory.content(t) for t in SIZES}

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _run(self, command: object) -> None:
        """Run a command; a refusal or failure must be logged and, if refused, change nothing."""
        before = self.ctl.projection.to_dict()
        seq = self.ctl.last_seq
        try:
            command()  # type: ignore[operator]
        except TorporError:
            new = self.ctl.events(after=seq)
            assert new, "a failed command recorded nothing"
            kinds = {e.kind for e in new} - {EventKind.SNAPSHOT}  # a log rotation may follow any event
            if kinds == {EventKind.REFUSED}:
                after = self.ctl.projection.to_dict()
                for key in ("state", "residency", "since", "pool", "graphs"):
                    assert after[key] == before[key], key
            else:
                assert kinds & {
                    EventKind.SLEEP_ABORTED,
                    EventKind.WAKE_FAILED,
                    EventKind.SLEEP_COMPLETED,
                    EventKind.DISCARD_COMPLETED,
                }

    @rule(level=st.integers(0, 3))
    def sleep(self, level: int) -> None:
        offloaded_before = {t: self.memory.content(t) for t in SIZES}
        self._run(lambda: self.ctl.sleep(level))
        if self.ctl.state in (State.ASLEEP_L1, State.ASLEEP_L2):
            for tag, usage in self.ctl.projection.residency.items():
                if usage.host and offloaded_before.get(tag) is not None:
                    self.expected[tag] = offloaded_before[tag]

    @rule(tags=st.none() | st.lists(st.sampled_from(TAGS), max_size=3, unique=True))
    def wake(self, tags: list[str] | None) -> None:
        from_host = {t for t, u in self.ctl.projection.residency.items() if u.host}
        self._run(lambda: self.ctl.wake(tags))
        for tag in from_host:
            if self.ctl.projection.residency[tag].resident:
                assert self.memory.content(tag) == self.expected[tag], f"{tag} lost its content"

    @rule(tags=st.lists(st.sampled_from(TAGS), min_size=1, max_size=2, unique=True))
    def discard(self, tags: list[str]) -> None:
        self._run(lambda: self.ctl.discard(tags))

    @rule(site=st.sampled_from(["batch=1", "batch=8"]))
    def capture(self, site: str) -> None:
        def go() -> None:
            with self.ctl.capture(site):
                pass

        self._run(go)

    @rule()
    def release_pool(self) -> None:
        self._run(self.ctl.release_cudagraph_pool)

    @precondition(lambda self: bool(self.memory.graphs))
    @rule()
    def drop_graph(self) -> None:
        self.memory.drop_graph(self.memory.graphs[0])

    @rule(op=st.sampled_from(OPERATIONS), tag=st.sampled_from([*SIZES, "*"]))
    def inject_failure(self, op: str, tag: str) -> None:
        self.memory.fail_once(op, tag)

    @rule()
    def reopen(self) -> None:
        """A new controller on the same log and memory continues where the old one stopped."""
        if self.ctl.state is not State.AWAKE:
            return
        self.ctl.close()
        self.ctl = SleepController(self.memory, log=EventLog(self.dir / "e.jsonl", fsync=False, max_bytes=8000))

    @invariant()
    def replay_equals_live(self) -> None:
        live = self.ctl.projection.to_dict()
        replayed = replay(self.dir / "e.jsonl").to_dict()
        assert replayed == live

    @invariant()
    def residency_is_exclusive_and_true(self) -> None:
        actual = self.memory.usage()
        for tag, usage in self.ctl.projection.residency.items():
            assert sum(1 for v in (usage.resident, usage.host, usage.discarded) if v) <= 1, tag
            if tag in actual and self.ctl.state not in (State.SUSPENDING, State.RESUMING):
                real = actual[tag]
                assert (usage.resident, usage.host, usage.discarded) == (real.resident, real.host, real.discarded), tag

    @invariant()
    def state_moves_only_along_the_table(self) -> None:
        assert off_table_moves(self.ctl.events()) == []

    @invariant()
    def never_transitional_between_commands(self) -> None:
        assert self.ctl.state not in (State.SUSPENDING, State.RESUMING)


ControllerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestController = ControllerMachine.TestCase
TestController.__doc__ = (
    "Random command sequences keep replay == live, refusals logged and inert, residency exclusive, moves on the table."
)
