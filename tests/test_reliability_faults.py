"""Fault matrix: every memory/driver call made during sleep and wake fails once, in turn; nothing is lost and the log agrees.

The calls are enumerated from a dry run of each scenario, so a call the
allocator starts making is covered without editing this file. Two rigs run the
same matrix: ``FakeMemory`` (per operation and tag) and, once it exists, the
real ``TaggedAllocator`` on the simulated device ``SimDriver`` (per driver call,
with real bytes compared exactly).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import pytest

from torpor.errors import NotRecovered, OutOfMemory, TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.policy import DEFAULT_POLICY, Action
from torpor.statemachine.core.protocol import Memory, Transfer
from torpor.statemachine.core.states import State
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import replay
from torpor.statemachine.machine.controller import SleepController
from torpor.testing import FakeMemory
from torpor.units import KiB, MiB

SIM_GRANULARITY = 16 * KiB
SIM_CHUNK = 128 * KiB  # pinned host chunk: small, so a backup spans several chunks
TAGS = {"weights": 192 * KiB, "kv_cache": 256 * KiB, "runtime": 64 * KiB, "cudagraph": 128 * KiB}

#: Scenarios: commands run in order from awake. A wake's argument is the tags (None: all).
SCENARIOS: dict[str, list[tuple[str, Any]]] = {
    "l1-full": [("sleep", 1), ("wake", None)],
    "l1-weights-first": [("sleep", 1), ("wake", ["weights"]), ("wake", ["kv_cache"])],
    "l1-kv-first": [("sleep", 1), ("wake", ["kv_cache"]), ("wake", None)],
    "l2-reload": [("sleep", 2), ("wake", None)],
}


class Rig(Protocol):
    """A memory under test with fault injection, a call record and a way to read every tag's content."""

    memory: Memory

    def calls(self) -> list[Hashable]:
        """Every call made so far, as injectable keys, oldest first."""
        ...

    def arm(self, key: Hashable, nth: int) -> None:
        """Fail the ``nth`` next call ``key`` once."""
        ...

    def content(self) -> dict[str, Any]:
        """Each resident tag's content (bytes or a token); released tags are absent."""
        ...

    def scribble(self) -> None:
        """Change every resident tag's content, as a running engine would."""
        ...

    def call_name(self, key: Hashable) -> str:
        """The words an error must contain to name the failed call."""
        ...

    def settle(self) -> None:
        """Wait for the work a command left running in the background, so each command's calls are the same every run."""
        ...

    def close(self) -> None:
        """Free what the rig holds."""
        ...


# -- rigs -------------------------------------------------------------------------------


class FakeRig:
    """FakeMemory: keys are (operation, tag)."""

    def __init__(self) -> None:
        self.fake = FakeMemory(TAGS)
        self.memory: Memory = self.fake

    def calls(self) -> list[Hashable]:
        """FakeMemory's record of (operation, tag)."""
        return list(self.fake.calls)

    def arm(self, key: Hashable, nth: int) -> None:
        """FakeMemory fails the next (operation, tag); nth is always 1 within one command."""
        operation, tag = key  # type: ignore[misc]
        for _ in range(nth):
            self.fake.fail_once(operation, tag)

    def content(self) -> dict[str, Any]:
        """Content tokens of resident tags."""
        return {t: self.fake.content(t) for t in TAGS if self.fake.content(t) is not None}

    def scribble(self) -> None:
        """New tokens for every resident tag."""
        for tag in TAGS:
            if self.fake.content(tag) is not None:
                self.fake.write(tag)

    def close(self) -> None:
        """Nothing to free."""

    def settle(self) -> None:
        """FakeMemory runs nothing in the background."""

    def call_name(self, key: Hashable) -> str:
        """FakeMemory's errors say 'FakeMemory.<operation>'."""
        return f"FakeMemory.{key[0]}"  # type: ignore[index]


def _sim_available() -> bool:
    try:
        from torpor.allocator import SimDriver, TaggedAllocator  # noqa: F401
    except ImportError:
        return False
    return True


class SimMatrixRig:
    """The fault matrix on torpor.testrig's rig (TaggedAllocator on SimDriver): keys are driver call names; content is the real bytes of each allocation."""

    def __init__(
        self, seed: int = 0, *, prepin: bool = True, host_capacity: int = 64 * MiB, group_bytes: int = 64 * MiB
    ) -> None:
        from torpor.allocator import HostPolicy
        from torpor.statemachine.core.policy import DEFAULT_POLICY
        from torpor.testrig import sim_rig

        # the tags the default policy never backs up are not pinned ahead (the controller passes the same)
        policy = HostPolicy(
            prepin=prepin, chunk_bytes=SIM_CHUNK, threads=1, prepin_exclude=DEFAULT_POLICY.never_backed_up()
        )
        # host addresses given back are reused, as mmap after munmap may (a failed pin must not mix backups)
        made = sim_rig(
            64 * MiB,
            host_capacity=host_capacity,
            granularity=SIM_GRANULARITY,
            reuse_host=True,
            host=policy,
            group_bytes=group_bytes,
        )
        self.rig = made
        self.driver, self.allocator = made.driver, made.allocator
        self.memory = self.allocator
        self.rng = random.Random(seed)
        self.blocks: dict[str, list[tuple[int, int]]] = {}
        for tag, size in TAGS.items():
            # two allocations per tag, one not a multiple of the granularity
            sizes = [size // 2, size - size // 2 - 4096]
            self.blocks[tag] = [(self.allocator.allocate(n, tag), n) for n in sizes]
        self.scribble()
        # pinning ahead runs in the background: let it finish so every run makes the same calls
        self.allocator.wait_host_ready(30)

    def close(self) -> None:
        """Free everything (device, pinned host, the pinning thread; the handles a failed release left)."""
        self.rig.close()

    def calls(self) -> list[Hashable]:
        """Driver call names, in order."""
        return [c.call for c in self.driver.calls]

    def arm(self, key: Hashable, nth: int) -> None:
        """SimDriver.fail(call, nth)."""
        self.driver.fail(str(key), nth=nth, times=1)

    def content(self) -> dict[str, Any]:
        """The bytes of every allocation of each resident tag."""
        usage = self.allocator.usage()
        out: dict[str, Any] = {}
        for tag, blocks in self.blocks.items():
            if usage[tag].resident:
                out[tag] = [hashlib.sha256(self.driver.read(addr, n)).hexdigest() for addr, n in blocks]
        return out

    def scribble(self) -> None:
        """Random bytes into every allocation of each resident tag."""
        usage = self.allocator.usage()
        for tag, blocks in self.blocks.items():
            if tag not in usage or usage[tag].resident:
                for addr, n in blocks:
                    self.driver.write(addr, self.rng.randbytes(n))

    def call_name(self, key: Hashable) -> str:
        """A driver error names its call."""
        return str(key)

    def settle(self) -> None:
        """Wait for the pins a staged sleep left to the background and for background trims (their calls are that command's)."""
        if not self.allocator._host.wait_ready(30) or not self.allocator.wait_host_unpinned(30):
            msg = "background pinning or unpinning still running after 30 s"
            raise TimeoutError(msg)


def _rig(kind: str) -> Rig:
    """``fake``; ``sim`` (host memory pinned ahead); ``sim-nopin`` (pinned inside backup, so host_alloc is in the matrix).

    ``sim-split``: pinned ahead, one copy batch and one wake span per allocation
    (``group_bytes`` of one granule), so a release unmaps several mappings per
    tag and a wake's rollback can fail half-way through one.
    """
    if kind == "fake":
        return FakeRig()
    return SimMatrixRig(prepin=kind != "sim-nopin", group_bytes=SIM_GRANULARITY if kind == "sim-split" else 64 * MiB)


# -- running a scenario -------------------------------------------------------------------


def _run(ctrl: SleepController, command: tuple[str, Any]) -> None:
    name, arg = command
    if name == "sleep":
        ctrl.sleep(arg)
    else:
        ctrl.wake(arg)


def _offloaded(level: int) -> set[str]:
    plan = DEFAULT_POLICY.plan(level, TAGS)
    return {t for t, a in plan.items() if a is Action.OFFLOAD}


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: in ``scenario``, command number ``step`` meets the ``nth`` call ``key`` failing."""

    scenario: str
    step: int
    key: Hashable
    nth: int

    def __str__(self) -> str:
        return f"{self.scenario}[{self.step}:{SCENARIOS[self.scenario][self.step][0]}]-{self.key}#{self.nth}"


def _cases(kind: str) -> list[Case]:
    """Dry-run each scenario and list every call each command made (each occurrence of each call)."""
    out: list[Case] = []
    for scenario, commands in SCENARIOS.items():
        rig = _rig(kind)
        try:
            ctrl = SleepController(rig.memory)
            for step, command in enumerate(commands):
                before = len(rig.calls())
                _run(ctrl, command)
                rig.settle()
                seen: Counter[Hashable] = Counter()
                made = []
                for key in rig.calls()[before:]:
                    seen[key] += 1
                    made.append(Case(scenario, step, key, seen[key]))
                # by call and occurrence: threads (pins, copies) interleave differently from run to run
                out += sorted(made, key=lambda c: (str(c.key), c.nth))
        finally:
            rig.close()
    return out


def _matrix(kind: str) -> list[Any]:
    if kind != "fake" and not _sim_available():
        return [pytest.param(None, id="sim-not-built", marks=pytest.mark.skip(reason="TaggedAllocator not built yet"))]
    return [pytest.param(case, id=str(case)) for case in _cases(kind)]


class Armed(NamedTuple):
    """A case's scenario run up to the command that meets the fault, with the fault armed."""

    ctrl: SleepController
    path: Path
    commands: list[tuple[str, Any]]
    level: int  # the scenario's sleep level
    original: dict[str, Any]  # every tag's content before the scenario
    state: State  # and the state and last event before the failing command
    seq: int


def _arm(rig: Rig, case: Case, tmp_path: Path) -> Armed:
    """A controller logging to ``tmp_path/e.jsonl`` runs the case's commands before its step, then the fault is armed."""
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(rig.memory, EventLog(path, fsync=False))
    commands = SCENARIOS[case.scenario]
    original = rig.content()
    for command in commands[: case.step]:
        _run(ctrl, command)
        rig.settle()
    armed = Armed(ctrl, path, commands, commands[0][1], original, ctrl.state, ctrl.last_seq)
    rig.arm(case.key, case.nth)
    return armed


def _finish(ctrl: SleepController, commands: Sequence[tuple[str, Any]]) -> None:
    """Run the scenario's remaining ``commands`` (skipping a wake of an engine already awake), then wake what still sleeps."""
    for command in commands:
        if command[0] == "wake" and ctrl.state is State.AWAKE:
            continue
        _run(ctrl, command)
    if ctrl.state is not State.AWAKE:
        ctrl.wake()


def _next_cycle_keeps_its_bytes(rig: Rig, ctrl: SleepController, label: object) -> None:
    """New content written, then a level-1 cycle: every offloaded tag reads back what was written."""
    rig.scribble()
    again = rig.content()
    ctrl.sleep(1)
    ctrl.wake()
    after = rig.content()
    for tag in _offloaded(1):
        assert after[tag] == again[tag], f"next cycle lost {tag!r} ({label})"


def _check_offloaded_back(rig: Rig, case: Case, level: int, original: dict[str, Any]) -> None:
    """Every tag the scenario's sleep offloaded has its original content again."""
    after = rig.content()
    for tag in _offloaded(level):
        assert after[tag] == original[tag], f"offloaded tag {tag!r} lost bytes ({case})"


def _agree(ctrl: SleepController, path: Path) -> None:
    """The log and the live controller say the same, and the controller matches the memory's own usage."""
    assert replay(path).to_dict() == ctrl.projection.to_dict()
    usage = ctrl.memory.usage()
    for tag, u in ctrl.projection.residency.items():
        if tag in usage:
            assert (u.resident > 0) == (usage[tag].resident > 0), f"{tag}: controller {u}, memory {usage[tag]}"


def _check_aborted_sleep(
    ctrl: SleepController, level: int, seq: int, now: dict[str, Any], original: dict[str, Any]
) -> None:
    """An aborted sleep keeps every tag's content, except discarded tags it had (partly) released, which it names as lost."""
    new = ctrl.events(after=seq)
    (aborted,) = [e for e in new if e.kind is EventKind.SLEEP_ABORTED]
    lost = set(aborted.data.get("lost", ()))
    assert {e.data["tag"] for e in new if e.kind is EventKind.TAG_RESTORED and e.data.get("lost")} <= lost
    for tag in lost:
        assert tag in aborted.data["reason"]
    assert not lost & _offloaded(level), "an offloaded tag was reported lost"
    for tag, content in original.items():
        if tag not in lost:
            assert now.get(tag) == content, f"an aborted sleep changed {tag!r} without saying so"


def _check_case(kind: str, case: Case, tmp_path: Path) -> None:
    rig = _rig(kind)
    try:
        _check_case_on(rig, case, tmp_path)
    finally:
        rig.close()


def _check_case_on(rig: Rig, case: Case, tmp_path: Path) -> None:
    ctrl, path, commands, level, original, state, seq = _arm(rig, case, tmp_path)
    try:
        _run(ctrl, commands[case.step])
    except TorporError as exc:
        text = str(exc)
        assert rig.call_name(case.key) in text, f"error does not name the failed call {case.key}: {text}"
        assert ctrl.state is state, f"a failed {commands[case.step][0]} moved {state} -> {ctrl.state}"
        kinds = {e.kind for e in ctrl.events(after=seq)}
        assert kinds & {EventKind.SLEEP_ABORTED, EventKind.WAKE_FAILED, EventKind.REFUSED}, kinds
        if commands[case.step][0] == "sleep":
            _check_aborted_sleep(ctrl, level, seq, rig.content(), original)
    else:
        assert ctrl.state is not state, "the command neither failed nor moved the state"
    rig.settle()
    _agree(ctrl, path)
    # complete the scenario, then wake everything: every offloaded byte is back
    _finish(ctrl, commands[case.step + 1 :])
    assert ctrl.state is State.AWAKE
    _check_offloaded_back(rig, case, level, original)
    _agree(ctrl, path)
    # the memory works for the next cycle
    _next_cycle_keeps_its_bytes(rig, ctrl, case)
    _agree(ctrl, path)


@pytest.mark.parametrize("case", _matrix("fake"))
def test_fault_matrix_fake_memory(tmp_path: Path, case: Case) -> None:
    """Each FakeMemory operation of each scenario failing once: clear error, state and log agree, nothing offloaded is lost."""
    _check_case("fake", case, tmp_path)


@pytest.mark.parametrize("case", _matrix("sim"))
def test_fault_matrix_sim_driver(tmp_path: Path, case: Case) -> None:
    """Each SimDriver call of each scenario failing once: clear error, state and log agree, every offloaded byte exact."""
    _check_case("sim", case, tmp_path)


@pytest.mark.parametrize("case", _matrix("sim-nopin"))
def test_fault_matrix_sim_driver_pinning_in_backup(tmp_path: Path, case: Case) -> None:
    """As above with no pinning ahead: host allocation happens inside backup, and each of its calls fails in turn too."""
    _check_case("sim-nopin", case, tmp_path)


def test_matrix_covers_sleep_and_wake_calls() -> None:
    """The dry run finds calls in both sleep and wake of every scenario (the matrix is not empty by accident)."""
    cases = _cases("fake")
    for scenario, commands in SCENARIOS.items():
        for step in range(len(commands)):
            assert any(c.scenario == scenario and c.step == step for c in cases), (scenario, step)
    keys = {c.key[0] for c in cases}  # type: ignore[index]
    assert {"backup", "release", "restore"} <= keys


@pytest.mark.skipif(not _sim_available(), reason="TaggedAllocator not built yet")
def test_matrix_covers_every_driver_call_sleep_and_wake_make() -> None:
    """Every SimDriver call that sleep or wake makes appears in the matrix, and each is a call SimDriver can fail."""
    from torpor.allocator import SimDriver

    keys = {str(c.key) for kind in ("sim", "sim-nopin") for c in _cases(kind)}
    assert keys <= set(SimDriver.CALLS)
    assert {"unmap", "create", "map", "set_access", "copy_d2h", "copy_h2d", "host_alloc"} <= keys


@pytest.mark.skipif(not _sim_available(), reason="TaggedAllocator not built yet")
def test_matrix_is_the_same_when_background_pins_are_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dry run lists the same cases, in the same order, whether the pins after a staged sleep finish at once or late."""
    from torpor.allocator import SimDriver

    fast = [str(c) for c in _cases("sim-nopin")]
    register = SimDriver._host_register

    def slow_register(self: SimDriver, host: int, nbytes: int) -> None:
        time.sleep(0.05)  # a loaded machine: the background pins run into the next command
        register(self, host, nbytes)

    monkeypatch.setattr(SimDriver, "_host_register", slow_register)
    slow = [str(c) for c in _cases("sim-nopin")]
    assert any("host_register" in c for c in fast), "the rig no longer pins in the background"
    assert slow == fast, sorted(set(slow) ^ set(fast))[:10] or "the same cases in another order"


# -- host out of memory while backing up -----------------------------------------------


class HostOomMemory(FakeMemory):
    """FakeMemory whose backup runs out of host memory at the second tag (after backing up the first)."""

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Back up the first tag, then fail like a pinned-memory allocation that ran out."""
        done = super().backup(tags[:1])
        if len(tags) > 1:
            for tag in done:
                self._tags[tag].backup = None
            raise OutOfMemory("backup", tags[1], "cannot pin host memory: 0 bytes free", call="host_alloc")
        return done


def _check_host_oom(ctrl: SleepController, path: Path, content: dict[str, Any], now: dict[str, Any]) -> None:
    assert ctrl.state is State.AWAKE
    assert now == content, "a sleep aborted for host memory changed resident content"
    last = [e for e in ctrl.events() if e.kind is EventKind.SLEEP_ABORTED][-1]
    assert last.data["error"].endswith("OutOfMemory")
    assert "backup failed" in last.data["reason"]
    assert not [e for e in ctrl.events() if e.kind is EventKind.TAG_RELEASED]
    assert replay(path).to_dict() == ctrl.projection.to_dict()


def test_host_oom_while_backing_up_fake(tmp_path: Path) -> None:
    """Host memory running out during backup: sleep aborted with OutOfMemory, still awake, nothing released."""
    mem = HostOomMemory(TAGS)
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(mem, EventLog(path, fsync=False))
    content = {t: mem.content(t) for t in TAGS}
    with pytest.raises(OutOfMemory, match="pin host memory"):
        ctrl.sleep(1)
    _check_host_oom(ctrl, path, content, {t: mem.content(t) for t in TAGS})
    assert all(u.resident and not u.host for u in mem.usage().values())


@pytest.mark.skipif(not _sim_available(), reason="TaggedAllocator not built yet")
@pytest.mark.parametrize("prepin", [True, False], ids=["pinned-ahead", "pinned-in-backup"])
@pytest.mark.parametrize("level", [1, 2])
def test_host_oom_while_backing_up_sim(tmp_path: Path, level: int, prepin: bool) -> None:
    """SimDriver with too little pinned host memory: sleep aborted, still awake, every byte resident, device use unchanged."""
    rig = SimMatrixRig(prepin=prepin, host_capacity=SIM_CHUNK)
    try:
        path = tmp_path / "e.jsonl"
        ctrl = SleepController(rig.memory, EventLog(path, fsync=False))
        content = rig.content()
        used = rig.driver.used
        with pytest.raises(OutOfMemory):
            ctrl.sleep(level)
        _check_host_oom(ctrl, path, content, rig.content())
        assert rig.driver.used == used
        assert rig.driver.host_used <= SIM_CHUNK
        # the engine keeps serving: scribble, then a sleep that fits (nothing offloaded but the small tags) still works
        rig.scribble()
        assert ctrl.state is State.AWAKE
    finally:
        rig.close()


# -- the graph pool's own memory calls -----------------------------------------------------


def test_failed_capture_is_logged_and_changes_nothing(tmp_path: Path) -> None:
    """A memory failure entering a capture raises a TorporError naming it, is logged, and leaves no graph behind."""
    mem = FakeMemory(TAGS)
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(mem, EventLog(path, fsync=False))
    mem.fail_once("capture", "decode batch=4")
    seq = ctrl.last_seq
    with pytest.raises(TorporError, match=r"FakeMemory\.capture"), ctrl.capture("decode batch=4"):
        pytest.fail("the capture body ran after the pool failed")
    new = ctrl.events(after=seq)
    assert [e.kind for e in new] == [EventKind.REFUSED]
    assert new[0].data["command"] == "capture"
    assert mem.graphs == []
    assert ctrl.projection.graphs == []
    assert replay(path).to_dict() == ctrl.projection.to_dict()
    with ctrl.capture("decode batch=4"):
        pass
    assert ctrl.projection.graphs == ["decode batch=4"]


def test_failed_pool_release_is_logged_and_keeps_the_pool(tmp_path: Path) -> None:
    """A memory failure releasing the graph pool raises, is logged, and the pool is still there for a retry."""
    mem = FakeMemory(TAGS)
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(mem, EventLog(path, fsync=False))
    with ctrl.capture("decode batch=1"):
        pass
    mem.drop_graph("decode batch=1")
    mem.fail_once("release_pool", "cudagraph")
    seq = ctrl.last_seq
    with pytest.raises(TorporError, match=r"FakeMemory\.release_pool"):
        ctrl.release_cudagraph_pool()
    new = ctrl.events(after=seq)
    assert [e.kind for e in new] == [EventKind.REFUSED]
    assert ctrl.projection.pool is not None
    assert replay(path).to_dict() == ctrl.projection.to_dict()
    assert ctrl.release_cudagraph_pool() > 0
    assert ctrl.projection.pool is None


# -- two faults in a row ----------------------------------------------------------------------


@pytest.mark.skipif(not _sim_available(), reason="TaggedAllocator not built yet")
def test_wake_succeeds_after_a_rollback_that_could_not_unmap(tmp_path: Path) -> None:
    """A wake fails, and undoing it fails too (an unmap): once the faults are gone, the next wake restores every byte."""
    rig = SimMatrixRig()
    try:
        path = tmp_path / "e.jsonl"
        ctrl = SleepController(rig.memory, EventLog(path, fsync=False))
        original = rig.content()
        ctrl.sleep(1)
        rig.driver.fail("set_access", nth=1)  # the wake's first tag fails after its memory is mapped
        rig.driver.fail("unmap", nth=1)  # and unmapping it again fails as well
        with pytest.raises(TorporError, match="set_access"):
            ctrl.wake()
        assert ctrl.state is State.ASLEEP_L1
        _agree(ctrl, path)
        ctrl.wake()
        assert ctrl.state is State.AWAKE
        after = rig.content()
        for tag in _offloaded(1):
            assert after[tag] == original[tag], f"{tag} lost bytes"
    finally:
        rig.close()


# -- two faults: the first anywhere, the second at each call after it (the rollback paths) ----------


@dataclass(frozen=True)
class Double:
    """A cell of the double-fault matrix: ``first`` fails, then the ``nth`` call ``key`` of the same command does too.

    ``nth`` counts from the start of the failing command, as the dry run with
    the first fault armed made its calls; so the calls a rollback makes (and no
    clean run does) are faulted too.
    """

    first: Case
    key: str
    nth: int

    def __str__(self) -> str:
        return f"{self.first}+{self.key}#{self.nth}"


def _calls_after_first_fault(kind: str, case: Case) -> list[str]:
    """The driver calls the case's command makes from its start, with the first fault armed (up to the end)."""
    rig = _rig(kind)
    try:
        ctrl = SleepController(rig.memory)
        commands = SCENARIOS[case.scenario]
        for command in commands[: case.step]:
            _run(ctrl, command)
            rig.settle()
        before = len(rig.calls())
        rig.arm(case.key, case.nth)
        with contextlib.suppress(TorporError):
            _run(ctrl, commands[case.step])
        rig.settle()
        return [str(k) for k in rig.calls()[before:]]
    finally:
        rig.close()


def _doubles(kind: str) -> list[Double]:
    """Every first fault of the single matrix, paired with each call made after it in the same command."""
    out: list[Double] = []
    for case in _cases(kind):
        calls = _calls_after_first_fault(kind, case)
        seen: Counter[str] = Counter()
        failed_at = None
        for i, key in enumerate(calls):
            seen[key] += 1
            if failed_at is None and key == case.key and seen[key] == case.nth:
                failed_at = i
            elif failed_at is not None:
                out.append(Double(case, key, seen[key]))
    return out


def _check_double_on(rig: SimMatrixRig, cell: Double, tmp_path: Path) -> None:
    """Both faults armed before the command: whatever it does, it never lies, loses no backed-up byte, and the engine goes on."""
    case = cell.first
    ctrl, path, commands, level, original, state, seq = _arm(rig, case, tmp_path)
    rig.arm(cell.key, cell.nth)
    try:
        _run(ctrl, commands[case.step])
    except TorporError as exc:
        assert rig.call_name(case.key) in str(exc) or rig.call_name(cell.key) in str(exc), str(exc)
        if ctrl.state in (State.SUSPENDING, State.RESUMING):  # a rollback that could not complete says so
            with pytest.raises(NotRecovered):
                _run(ctrl, commands[case.step])
            _agree_with_memory(ctrl, rig)
            assert replay(path).to_dict() == ctrl.projection.to_dict()
            ctrl.recover()
        elif ctrl.state is not state:  # only a sleep whose rollback failed may end asleep, and it says so
            (last,) = [e for e in ctrl.events(after=seq) if e.kind is EventKind.SLEEP_COMPLETED]
            assert last.data.get("incomplete"), f"a failed {commands[case.step][0]} moved {state} -> {ctrl.state}"
            assert "rolling back failed too" in str(exc)
    rig.driver.clear_faults()
    _agree(ctrl, path)
    _agree_with_memory(ctrl, rig)
    if ctrl.state is State.AWAKE and commands[case.step][0] == "sleep":
        _check_offloaded_resident(rig, cell, level, original)
    _finish(ctrl, commands[case.step + 1 :])
    assert ctrl.state is State.AWAKE
    _check_offloaded_back(rig, case, level, original)
    _agree(ctrl, path)
    _agree_with_memory(ctrl, rig)
    _next_cycle_keeps_its_bytes(rig, ctrl, cell)
    for tag in TAGS:  # every tag takes allocations again
        rig.allocator.free(rig.allocator.allocate(4096, tag))
    _agree(ctrl, path)


def _check_offloaded_resident(rig: SimMatrixRig, cell: Double, level: int, original: dict[str, Any]) -> None:
    """After an aborted sleep every offloaded tag holds its bytes (the discarded ones may be fresh)."""
    now = rig.content()
    for tag in _offloaded(level):
        assert now[tag] == original[tag], f"an aborted sleep changed {tag!r} ({cell})"


def _agree_with_memory(ctrl: SleepController, rig: SimMatrixRig) -> None:
    """A tag the controller calls resident is mapped and readable in the device, all of it; one it calls asleep is not mapped."""
    usage = rig.allocator.usage()
    for tag, u in ctrl.projection.residency.items():
        if tag not in rig.blocks:
            continue
        if u.resident:
            for address, n in rig.blocks[tag]:
                rig.driver.read(address, n)  # raises when any byte is unmapped
        assert (u.resident > 0) == (usage[tag].resident > 0), f"{tag}: controller {u}, memory {usage[tag]}"


def _double_matrix(kind: str) -> list[Any]:
    if not _sim_available():
        return [pytest.param(None, id="sim-not-built", marks=pytest.mark.skip(reason="TaggedAllocator not built yet"))]
    cells = [c for i, c in enumerate(_doubles(kind)) if _sampled(kind, i, c)]
    groups: dict[tuple[str, int], list[Double]] = {}
    for cell in cells:
        groups.setdefault((cell.first.scenario, cell.first.step), []).append(cell)
    return [pytest.param(group, id=f"{s}[{step}]") for (s, step), group in groups.items()]


#: Second faults at these calls decide what a rollback maps, unmaps or copies: every such cell runs.
_DECISIVE = frozenset({"unmap", "create", "map", "set_access", "copy_h2d", "copy_d2h"})


def _sampled(kind: str, index: int, cell: Double) -> bool:
    """The deterministic sample that keeps the double-fault matrix in CI time (docs/reliability.md).

    ``sim-split``: every cell whose second fault is a mapping or copy call, one
    in four of the rest (release, wait, synchronize, record, mem_info).
    ``sim-nopin``: the cells with a host call in them (what this rig adds).
    """
    if kind == "sim-nopin":
        return "host" in f"{cell.first.key}{cell.key}"
    return cell.key in _DECISIVE or "host" in cell.key or index % 4 == 0


def _check_doubles(kind: str, cells: list[Double], tmp_path: Path) -> None:
    failures = []
    for i, cell in enumerate(cells):
        rig = _rig(kind)
        assert isinstance(rig, SimMatrixRig)
        try:
            _check_double_on(rig, cell, tmp_path / str(i))
        except Exception as exc:  # collect, then report every failing cell at once
            failures.append(f"{cell}: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            rig.close()
    assert not failures, f"{len(failures)} of {len(cells)} cells failed:\n" + "\n".join(failures[:40])


@pytest.mark.parametrize("cells", _double_matrix("sim-split"))
def test_double_fault_matrix_sim_driver(tmp_path: Path, cells: list[Double]) -> None:
    """Every first fault with a second at each later call of the command: no lie, no lost byte, NotRecovered or a working engine."""
    _check_doubles("sim", cells, tmp_path)


@pytest.mark.parametrize("cells", _double_matrix("sim-nopin"))
def test_double_fault_matrix_sim_driver_pinning_in_backup(tmp_path: Path, cells: list[Double]) -> None:
    """As above with pinning inside backup, so the host calls and their rollbacks meet a second fault too."""
    _check_doubles("sim-nopin", cells, tmp_path)


@pytest.mark.skipif(not _sim_available(), reason="TaggedAllocator not built yet")
def test_a_sleep_whose_second_unmap_and_first_create_fail_loses_nothing(tmp_path: Path) -> None:
    """The issue's cell: the second unmap and the map back's create fail; the sleep is aborted, every tag resident and intact."""
    rig = SimMatrixRig()
    try:
        path = tmp_path / "e.jsonl"
        ctrl = SleepController(rig.memory, EventLog(path, fsync=False))
        original = rig.content()
        rig.driver.fail("unmap", nth=2)
        rig.driver.fail("create", nth=1)
        with pytest.raises(TorporError, match="unmap") as info:
            ctrl.sleep(1)
        assert "tag left resident" not in str(info.value)
        assert ctrl.state is State.AWAKE
        _agree(ctrl, path)
        _agree_with_memory(ctrl, rig)
        now = rig.content()
        for tag in _offloaded(1):
            assert now[tag] == original[tag], f"the aborted sleep changed {tag}"
        for tag in TAGS:
            rig.allocator.free(rig.allocator.allocate(4096, tag))
        ctrl.sleep(1)
        ctrl.wake()
        after = rig.content()
        for tag in _offloaded(1):
            assert after[tag] == original[tag], f"{tag} lost bytes"
    finally:
        rig.close()


@pytest.mark.skipif(not _sim_available(), reason="TaggedAllocator not built yet")
def test_a_discard_whose_unmap_and_map_back_fail_records_the_tag_released(tmp_path: Path) -> None:
    """discard(kv_cache) whose second unmap and the map back fail: the log says kv_cache went, as the memory does."""
    rig = SimMatrixRig()
    try:
        path = tmp_path / "e.jsonl"
        ctrl = SleepController(rig.memory, EventLog(path, fsync=False))
        rig.driver.fail("unmap", nth=2)
        rig.driver.fail("create", nth=1)
        with pytest.raises(TorporError, match="unmap"):
            ctrl.discard(["kv_cache"])
        _agree(ctrl, path)
        _agree_with_memory(ctrl, rig)
        assert "kv_cache" in ctrl.projection.asleep_tags()
        ctrl.wake()
        assert ctrl.state is State.AWAKE
        _agree_with_memory(ctrl, rig)
        rig.allocator.free(rig.allocator.allocate(4096, "kv_cache"))
    finally:
        rig.close()


@pytest.mark.skipif(not _sim_available(), reason="TaggedAllocator not built yet")
@pytest.mark.parametrize(
    "faults",
    [
        [("copy_h2d", 5), ("unmap", 3), ("create", 8)],  # the rollback's map back cannot create
        [("copy_h2d", 5), ("unmap", 3), ("copy_h2d", 6)],  # it maps back, and copying the backup in fails
        [("copy_h2d", 5), ("unmap", 5), ("set_access", 8)],
    ],
    ids=["create", "copy", "set_access"],
)
def test_a_wake_rollback_that_cannot_map_a_tag_back_loses_nothing(
    tmp_path: Path, faults: list[tuple[str, int]]
) -> None:
    """A wake fails, its rollback's release of a tag fails half-way, and mapping that tag back fails: the next wake restores every byte."""
    rig = _rig("sim-split")
    assert isinstance(rig, SimMatrixRig)
    try:
        path = tmp_path / "e.jsonl"
        ctrl = SleepController(rig.memory, EventLog(path, fsync=False))
        original = rig.content()
        ctrl.sleep(1)
        for call, nth in faults:
            rig.driver.fail(call, nth=nth)
        with pytest.raises(TorporError, match="copy_h2d"):
            ctrl.wake()
        rig.driver.clear_faults()
        assert ctrl.state is State.ASLEEP_L1
        _agree(ctrl, path)
        _agree_with_memory(ctrl, rig)
        ctrl.wake()
        assert ctrl.state is State.AWAKE
        _agree_with_memory(ctrl, rig)
        after = rig.content()
        for tag in _offloaded(1):
            assert after[tag] == original[tag], f"{tag} lost bytes"
        for tag in TAGS:
            rig.allocator.free(rig.allocator.allocate(4096, tag))
    finally:
        rig.close()
