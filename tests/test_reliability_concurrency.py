"""Concurrency: threads issuing random commands at one controller never deadlock, every refusal is logged, replay equals live."""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import itertools
import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from torpor.errors import TorporError
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.core.protocol import Transfer
from torpor.statemachine.core.states import State
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import read_events, replay
from torpor.statemachine.machine.controller import SleepController
from torpor.statemachine.machine.identity import _clip
from torpor.testing import FakeMemory

TAGS = {"weights": 4096, "kv_cache": 8192, "runtime": 1024, "workspace": 512, "cudagraph": 0}
THREADS = 6
SECONDS = 2.0
BOUND = 60.0  # no thread may still be running this long after the run ends
STEP = 0.0005


class SlowMemory(FakeMemory):
    """FakeMemory whose steps take a little time, so commands overlap; usage() is safe to call from any thread."""

    def __init__(self, tags: dict[str, int]) -> None:
        super().__init__(tags)
        self._mutex = threading.RLock()

    def usage(self) -> Any:
        """Usage, under the memory's own lock."""
        with self._mutex:
            return super().usage()

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Back up, slowly."""
        time.sleep(STEP)
        with self._mutex:
            return super().backup(tags)

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Release, slowly."""
        time.sleep(STEP)
        with self._mutex:
            return super().release(tags)

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Restore, slowly."""
        time.sleep(STEP)
        with self._mutex:
            return super().restore(tags)

    def fail_once(self, operation: str, tag: str = "*") -> None:
        """Arm a failure, under the lock."""
        with self._mutex:
            super().fail_once(operation, tag)


class FakeSide:
    """FakeMemory (slowed down) under the controller; faults per operation and tag."""

    def __init__(self) -> None:
        self.mem = SlowMemory(TAGS)
        self.memory: Any = self.mem

    def capture_body(self, ctrl: SleepController, rng: random.Random, site: str) -> None:
        """Capture at ``site``; usually drop the graph afterwards so the pool can be released."""
        with ctrl.capture(site):
            time.sleep(STEP)
        if rng.random() < 0.7:
            with self.mem._mutex:
                if site in self.mem.graphs:
                    self.mem.drop_graph(site)

    def arm(self, rng: random.Random) -> None:
        """Arm one memory failure."""
        self.mem.fail_once(rng.choice(["backup", "release", "restore", "drop_backup"]), rng.choice([*TAGS, "*"]))

    def clear_faults(self) -> None:
        """Disarm what nothing reached."""
        with self.mem._mutex:
            self.mem._failures.clear()

    def runtime(self) -> object:
        """The runtime tag's content."""
        return self.mem.content("runtime")

    def close(self) -> None:
        """Nothing to free."""


class _Graph:
    """Stands for a captured CUDA graph (the allocator holds it weakly)."""


class SimSide:
    """The real TaggedAllocator on SimDriver; faults at driver calls; runtime's real bytes checked."""

    CHAOS_CALLS = ("map", "create", "set_access", "copy_d2h", "copy_h2d", "host_alloc", "record", "wait", "unmap")

    def __init__(self) -> None:
        from torpor.allocator import HostPolicy
        from torpor.testrig import sim_rig

        kib = 1 << 10
        made = sim_rig(
            64 << 20, host_capacity=64 << 20, granularity=16 * kib, host=HostPolicy(chunk_bytes=128 * kib, threads=1)
        )
        self.driver, self.alloc = made.driver, made.allocator
        self.memory: Any = self.alloc
        sizes = {"weights": 96 * kib, "kv_cache": 128 * kib, "runtime": 32 * kib, "workspace": 16 * kib}
        self.blocks = {tag: (self.alloc.allocate(n, tag), n) for tag, n in sizes.items()}
        self.driver.write(self.blocks["runtime"][0], random.Random(7).randbytes(sizes["runtime"]))
        self.graphs: list[_Graph] = []
        self.lock = threading.Lock()

    def capture_body(self, ctrl: SleepController, rng: random.Random, site: str) -> None:
        """Capture at ``site`` (an allocation lands in the graph pool); keep some graphs alive a while."""
        graph = _Graph()
        with ctrl.capture(site) as cap:
            with contextlib.suppress(TorporError):  # a driver fault inside the body is the body's failure
                self.alloc.allocate(16 << 10)
            cap.track(graph)  # type: ignore[attr-defined]
        with self.lock:
            self.graphs.append(graph)
            while self.graphs and rng.random() < 0.7:
                self.graphs.pop(rng.randrange(len(self.graphs)))

    def arm(self, rng: random.Random) -> None:
        """Arm one driver failure, a few calls ahead."""
        self.driver.fail(rng.choice(self.CHAOS_CALLS), nth=rng.randint(1, 3))

    def clear_faults(self) -> None:
        """Disarm what nothing reached."""
        self.driver.clear_faults()

    def runtime(self) -> object:
        """The runtime tag's real bytes (None while released)."""
        if not self.alloc.usage()["runtime"].resident:
            return None
        address, n = self.blocks["runtime"]
        return hashlib.sha256(self.driver.read(address, n)).hexdigest()

    def close(self) -> None:
        """Free the device, the pinned host memory and the pinning thread."""
        self.alloc.close()


class Caller:
    """One thread's random commands and what they raised."""

    def __init__(self, ctrl: SleepController, side: FakeSide | SimSide, seed: int, stop: threading.Event) -> None:
        self.ctrl, self.side, self.rng, self.stop = ctrl, side, random.Random(seed), stop
        self.errors: list[TorporError] = []
        self.unexpected: list[BaseException] = []
        self.commands = 0
        self.seen: list[list[int]] = []

    def _capture(self) -> None:
        self.side.capture_body(self.ctrl, self.rng, f"site-{self.rng.randrange(1000)}")

    def _subscribe(self) -> None:
        seqs: list[int] = []
        self.seen.append(seqs)

        def on_event(event: Event) -> None:
            seqs.append(event.seq)
            self.ctrl.projection.to_dict()  # a subscriber reading the projection must not deadlock
            if self.rng.random() < 0.05:
                msg = "a subscriber that fails"
                raise RuntimeError(msg)

        unsubscribe = self.ctrl.subscribe(on_event)
        time.sleep(self.rng.uniform(0, 0.02))
        unsubscribe()

    def actions(self) -> list[Callable[[], object]]:
        """The command mix."""
        return [
            lambda: self.ctrl.sleep(self.rng.choice([1, 2, 1, 2, 3])),
            lambda: self.ctrl.wake(self.rng.choice([None, None, ["weights"], ["kv_cache"], ["nope"]])),
            lambda: self.ctrl.discard([self.rng.choice(["weights", "kv_cache", "cudagraph", "nope"])]),
            self._capture,
            self.ctrl.release_cudagraph_pool,
            self._subscribe,
            self.ctrl.observe,
            lambda: self.ctrl.wait_for(State.AWAKE, timeout=0.01),
            lambda: self.ctrl.record(EventKind.HOOK_DECISION, hook="test", active=True, detail="concurrent"),
        ]

    def run(self) -> None:
        """Issue random commands until told to stop."""
        actions = self.actions()
        while not self.stop.is_set():
            try:
                self.rng.choice(actions)()
            except TorporError as exc:
                self.errors.append(exc)
            except BaseException as exc:  # anything else is a bug
                self.unexpected.append(exc)
            self.commands += 1


@contextmanager
def _threads(callers: list[Caller], stop: threading.Event) -> Iterator[None]:
    threads = [threading.Thread(target=c.run, name=f"caller-{i}", daemon=True) for i, c in enumerate(callers)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        deadline = time.monotonic() + BOUND
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            faulthandler.dump_traceback(sys.stderr)
            pytest.fail(f"deadlock: {alive} still running {BOUND} s after the stop")


def _chaos(side: FakeSide | SimSide, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        side.arm(rng)
        time.sleep(rng.uniform(0.005, 0.03))


def _sim_available() -> bool:
    try:
        from torpor.allocator import SimDriver, TaggedAllocator  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("chaos", [False, True], ids=["clean", "with-memory-faults"])
@pytest.mark.parametrize(
    "memory",
    ["fake", pytest.param("sim", marks=pytest.mark.skipif(not _sim_available(), reason="TaggedAllocator missing"))],
)
def test_random_commands_from_threads(
    tmp_path: Path, memory: str, chaos: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Six threads of random commands (and memory faults): no deadlock, every error logged, replay equals live, nothing offloaded lost."""
    side = FakeSide() if memory == "fake" else SimSide()
    try:
        _random_commands(tmp_path, side, chaos, caplog)
    finally:
        side.close()


def _random_commands(tmp_path: Path, side: FakeSide | SimSide, chaos: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(
        logging.CRITICAL, logger="torpor"
    )  # failing subscribers are logged by design; keep the output short
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(side.memory, EventLog(path, fsync=False, max_bytes=64 * 1024))
    runtime = side.runtime()
    stop = threading.Event()
    callers = [Caller(ctrl, side, seed, stop) for seed in range(THREADS)]
    extra = [threading.Thread(target=_chaos, args=(side, stop, 99), daemon=True)] if chaos else []
    with _threads(callers, stop):
        for t in extra:
            t.start()
        time.sleep(SECONDS)
    for t in extra:
        t.join(BOUND)
    unexpected = [e for c in callers for e in c.unexpected]
    assert not unexpected, f"non-torpor exceptions escaped: {unexpected[:3]!r}"
    errors = [e for c in callers for e in c.errors]
    assert sum(c.commands for c in callers) > 200, "the threads hardly ran"

    events = list(read_events(path))
    kinds = Counter(e.kind.value for e in events)
    print(f"{sum(c.commands for c in callers)} commands, {len(errors)} errors; events: {dict(kinds)}")
    live = ctrl.projection.to_dict()
    assert replay(path).to_dict() == live
    assert [e.seq for e in events] == list(range(1, len(events) + 1))

    # every raised TorporError is in the log: a refusal, or the abort/failure of the command that raised it
    logged: Counter[tuple[str, str]] = Counter()
    for e in events:
        if e.kind is EventKind.REFUSED:
            logged[(e.data["error"], e.data["reason"])] += 1
        elif e.kind in (EventKind.SLEEP_ABORTED, EventKind.WAKE_FAILED) or (
            e.kind is EventKind.DISCARD_COMPLETED and e.data["error"]
        ):
            logged[(e.data["error"], "failed")] += 1
        elif e.kind is EventKind.SLEEP_COMPLETED and "incomplete" in e.data:  # the rollback failed too
            logged[("MemoryOperationFailed", "failed")] += 1
    raised: Counter[tuple[str, str]] = Counter()
    for err in errors:
        refused = (type(err).__name__, _clip(str(err), 2048))
        raised[refused if logged[refused] > raised[refused] else (type(err).__name__, "failed")] += 1
    missing = raised - logged
    assert not missing, f"raised but not logged: {dict(missing)}"
    assert sum(logged.values()) == len(errors), "the log holds refusals or failures that nobody saw raised"
    assert ctrl.projection.refusals == sum(1 for e in events if e.kind is EventKind.REFUSED)

    # every subscriber saw every fact in order; the only numbers it may miss are the log's rotation snapshots
    snapshots = {e.seq for e in events if e.kind is EventKind.SNAPSHOT}
    for seqs in (s for c in callers for s in c.seen):
        missed = {n for a, b in itertools.pairwise(seqs) for n in range(a + 1, b)}
        assert all(b > a for a, b in itertools.pairwise(seqs)), "a subscriber saw events out of order"
        assert missed <= snapshots, f"a subscriber missed events {sorted(missed - snapshots)[:5]}"

    # the controller still works and nothing offloaded was lost
    side.clear_faults()  # failures the chaos thread armed but nothing reached
    if ctrl.state is not State.AWAKE:
        ctrl.wake()
    assert ctrl.state is State.AWAKE
    assert side.runtime() == runtime, "runtime (always offloaded) lost its content"
    ctrl.sleep(1)
    ctrl.wake()
    assert side.runtime() == runtime
    assert replay(path).to_dict() == ctrl.projection.to_dict()


def test_command_in_flight_is_refused_not_queued(tmp_path: Path) -> None:
    """A command arriving while another is in flight is refused at once with CommandInFlight naming the other, and logged."""
    from torpor.errors import CommandInFlight

    entered, release = threading.Event(), threading.Event()

    class Blocking(FakeMemory):
        def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
            entered.set()
            release.wait(10)
            return super().backup(tags)

    path = tmp_path / "e.jsonl"
    ctrl = SleepController(Blocking(TAGS), EventLog(path, fsync=False))
    sleeper = threading.Thread(target=ctrl.sleep, args=(1,))
    sleeper.start()
    try:
        assert entered.wait(10)
        with pytest.raises(CommandInFlight, match=r"sleep\(level=1\)") as info:
            ctrl.wake()
        # Refused while the sleep is still blocked in backup: it did not wait for it (no wall-clock bound).
        assert sleeper.is_alive() and not release.is_set()
        assert info.value.in_flight == "sleep(level=1)"
        assert ctrl.events()[-1].kind is EventKind.REFUSED
    finally:
        release.set()
        sleeper.join(10)
    assert ctrl.state is State.ASLEEP_L1
    assert replay(path).to_dict() == ctrl.projection.to_dict()
