"""Crashes: a process killed mid-sleep or mid-wake leaves a log that replays, names the interrupted step, and refuses until recovered."""

from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from torpor.errors import NotRecovered
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.core.protocol import Transfer
from torpor.statemachine.core.states import TRANSITIONAL, State
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import read_events, replay, segments
from torpor.statemachine.machine.controller import SleepController
from torpor.statemachine.projection.view import Projection
from torpor.testing import FakeMemory

WORKER = Path(__file__).with_name("crash_worker.py")
TAGS = {"weights": 4096, "kv_cache": 8192, "runtime": 1024, "workspace": 512}
KILLS = 24


class Died(BaseException):
    """Stands for the process dying inside a memory call (not a TorporError: nothing catches it)."""


class DyingMemory(FakeMemory):
    """FakeMemory that 'dies' at its ``n``-th memory call (counting backup, release, restore, drop_backup)."""

    def __init__(
        self, tags: dict[str, int], die_at: int | None = None, on_death: Callable[[], None] | None = None
    ) -> None:
        super().__init__(tags)
        self.die_at = die_at
        self.on_death = on_death
        self.count = 0

    def _step(self) -> None:
        self.count += 1
        if self.die_at is not None and self.count == self.die_at:
            if self.on_death is not None:
                self.on_death()
            raise Died

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Back up, or die."""
        self._step()
        return super().backup(tags)

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Release, or die."""
        self._step()
        return super().release(tags)

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Restore, or die."""
        self._step()
        return super().restore(tags)

    def drop_backup(self, tags: Sequence[str]) -> None:
        """Drop backups, or die."""
        self._step()
        super().drop_backup(tags)


def _commands(ctrl: SleepController) -> dict[str, Callable[[], object]]:
    def capture() -> None:
        with ctrl.capture("decode batch=1"):
            pass

    return {
        "sleep": lambda: ctrl.sleep(1),
        "wake": ctrl.wake,
        "discard": lambda: ctrl.discard(["weights"]),
        "capture": capture,
        "release_pool": ctrl.release_cudagraph_pool,
    }


SIDE_FACTS = {
    EventKind.REFUSED,
    EventKind.HOOK_DECISION,
    EventKind.USAGE_OBSERVED,
    EventKind.SNAPSHOT,
    EventKind.CLOSED,
}


def _check_last_step(proj: Projection, events: Sequence[Event]) -> None:
    """The replayed last step names the last event that is a step (not a refusal, rotation or outside fact)."""
    steps = [e for e in events if e.kind not in SIDE_FACTS]
    if steps:  # a log that rotated keeps its last step inside the snapshot
        assert proj.last_step.startswith(f"#{steps[-1].seq} {steps[-1].kind.value}"), proj.last_step
    else:
        assert proj.last_step


def _check_interrupted_controller(path: Path, proj: Projection) -> SleepController:
    """A controller opened on an interrupted log refuses every command with NotRecovered, and logs each refusal."""
    ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=False))
    assert ctrl.projection.to_dict() == proj.to_dict()
    assert ctrl.state is proj.state
    for name, command in _commands(ctrl).items():
        seq = ctrl.last_seq
        with pytest.raises(NotRecovered) as info:
            command()
        assert info.value.state == proj.state.value
        assert info.value.step == proj.last_step
        assert proj.state.value in str(info.value)
        assert "recover()" in str(info.value)
        (refusal,) = ctrl.events(after=seq)
        assert refusal.kind is EventKind.REFUSED
        assert refusal.data["command"] == name
        assert refusal.data["error"] == "NotRecovered"
    assert ctrl.state is proj.state
    assert replay(path).to_dict() == ctrl.projection.to_dict()
    return ctrl


def _recover_and_cycle(ctrl: SleepController, path: Path) -> None:
    """recover() records the interrupted step, leaves the controller awake, and the next cycle works."""
    interrupted = ctrl.projection.state.value
    step = ctrl.projection.last_step
    proj = ctrl.recover()
    assert proj.state is State.AWAKE
    last = ctrl.events()[-1]
    assert last.kind is EventKind.RECOVERED
    assert last.data["interrupted_state"] == interrupted
    assert last.data["interrupted_step"] == step
    assert all(u.resident and not u.host for u in proj.residency.values())
    ctrl.sleep(1)
    ctrl.wake()
    assert ctrl.state is State.AWAKE
    assert replay(path).to_dict() == ctrl.projection.to_dict()


# -- deterministic crash points ----------------------------------------------------------


def _crash_points() -> int:
    """How many memory calls one full scenario makes (a dry run), so each can be a crash point."""
    mem = DyingMemory(TAGS)
    ctrl = SleepController(mem)
    _scenario(ctrl)
    return mem.count


def _scenario(ctrl: SleepController) -> None:
    ctrl.sleep(1)
    ctrl.wake(["weights"])
    ctrl.wake()
    ctrl.sleep(2)
    ctrl.wake()


@pytest.mark.parametrize("die_at", range(1, _crash_points() + 1))
def test_death_at_each_memory_call_is_reported_and_recoverable(tmp_path: Path, die_at: int) -> None:
    """Dying at the n-th memory call: replay says interrupted at that step; a new controller refuses until recover().

    The log a dead process leaves is the file as it was at that moment (copied
    there); the live controller, which saw the same exception as an interrupt,
    rolled back and agrees with its own log.
    """
    live_path, path = tmp_path / "live.jsonl", tmp_path / "e.jsonl"
    mem = DyingMemory(TAGS, die_at=die_at, on_death=lambda: shutil.copyfile(live_path, path))
    live = SleepController(mem, EventLog(live_path, fsync=True))
    with pytest.raises(Died):
        _scenario(live)
    live.log.close()  # type: ignore[union-attr]
    assert replay(live_path).to_dict() == live.projection.to_dict()
    assert not live.projection.interrupted
    proj = replay(path)
    events = list(read_events(path))
    assert proj.last_seq == events[-1].seq
    _check_last_step(proj, events)
    if proj.interrupted:
        assert proj.state in TRANSITIONAL
        ctrl = _check_interrupted_controller(path, proj)
        _recover_and_cycle(ctrl, path)
    else:  # died in a post-transition step (dropping backups after the wake was recorded)
        assert proj.state in (State.AWAKE, State.PARTIALLY_AWAKE, State.ASLEEP_L1, State.ASLEEP_L2)


def test_live_controller_rolls_back_an_escaping_interrupt(tmp_path: Path) -> None:
    """An exception that is no error (an interrupt) escaping the memory mid-sleep rolls the live controller back."""
    path = tmp_path / "e.jsonl"
    mem = DyingMemory(TAGS, die_at=3)  # drop_backup, backup, then the first release
    ctrl = SleepController(mem, EventLog(path, fsync=False))
    with pytest.raises(Died):
        ctrl.sleep(1)
    assert ctrl.state is State.AWAKE
    assert ctrl.events()[-1].kind is EventKind.SLEEP_ABORTED
    assert all(mem.content(t) is not None for t in TAGS)
    ctrl.sleep(1)
    ctrl.wake()
    assert replay(path).to_dict() == ctrl.projection.to_dict()


# -- SIGKILL ---------------------------------------------------------------------------


@contextmanager
def _worker(path: Path, seed: int, max_bytes: int) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(path), str(seed), str(max_bytes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def _wait_ready(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    stdout = proc.stdout
    if stdout is None:
        pytest.fail("worker has no stdout")
    ready, _, _ = select.select([stdout], [], [], timeout)
    line = stdout.readline() if ready else b""
    if line.strip() != b"ready":
        pytest.fail(f"crash worker did not start (exit status {proc.poll()}, said {line!r})")


def test_sigkill_at_random_points_always_replays(tmp_path: Path) -> None:
    """SIGKILL at random points, many times on one log: it always replays, names the interrupted step, and recovers."""
    path = tmp_path / "logs" / "engine.jsonl"
    rng = random.Random(int(os.environ.get("TORPOR_CRASH_SEED", "20261129")))
    interrupted = 0
    previous_last = 0
    for kill in range(KILLS):
        with _worker(path, seed=rng.randrange(1 << 30), max_bytes=16 * 1024) as proc:
            _wait_ready(proc)
            time.sleep(rng.uniform(0.01, 0.15))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            assert proc.returncode == -signal.SIGKILL, f"worker ended by itself (status {proc.returncode})"
        if kill % 6 == 5:  # also a torn last line, as a power cut mid-write would leave
            data = path.read_bytes()
            path.write_bytes(data[: len(data) - 7])
        events = list(read_events(path))
        seqs = [e.seq for e in events]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers must follow on"
        assert seqs[-1] >= previous_last - 1, "durable facts were lost"
        previous_last = seqs[-1]
        proj = replay(path)
        assert proj.last_seq == seqs[-1]
        _check_last_step(proj, events)
        assert proj.interrupted is (proj.state in TRANSITIONAL)
        if proj.interrupted:
            interrupted += 1
            ctrl = _check_interrupted_controller(path, proj)
            if kill % 2:
                _recover_and_cycle(ctrl, path)  # else the next worker recovers, as a restarted engine would
            ctrl.log.close()  # type: ignore[union-attr]
    print(f"{interrupted}/{KILLS} kills landed mid-transition")
    assert interrupted >= KILLS // 4, f"only {interrupted} of {KILLS} kills landed mid-transition"
    assert len(segments(path)) > 1, "the log never rotated under the kills"
    recovered = [e for e in read_events(path) if e.kind is EventKind.RECOVERED]
    assert recovered, "no recovery was recorded"
    assert all(e.data["interrupted_state"] in {s.value for s in TRANSITIONAL} for e in recovered)


# -- a crash inside log rotation -------------------------------------------------------


def _rotated_log(tmp_path: Path) -> tuple[Path, int]:
    """A log whose active file was just renamed to a segment (the first step of a rotation)."""
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=False))
    ctrl.sleep(1)
    ctrl.wake()
    ctrl.log.close()  # type: ignore[union-attr]
    last = ctrl.last_seq
    first = next(read_events(path)).seq
    os.replace(path, path.with_name(f"{path.name}.{first:012d}"))
    return path, last


@pytest.mark.parametrize("active", ["missing", "empty", "torn"])
def test_crash_mid_rotation_keeps_the_sequence(tmp_path: Path, active: str) -> None:
    """Killed between renaming the segment and writing the snapshot: reopening continues the sequence, replay still works."""
    path, last = _rotated_log(tmp_path)
    if active == "empty":
        path.write_bytes(b"")
    elif active == "torn":
        path.write_bytes(b'{"crc":"0000')
    before = replay(path)
    assert before.last_seq == last
    ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=False))
    assert ctrl.last_seq == last + 1  # the new 'opened' follows the segment's last event
    ctrl.sleep(1)
    ctrl.wake()
    seqs = [e.seq for e in read_events(path)]
    assert seqs == list(range(1, seqs[-1] + 1))
    assert replay(path).to_dict() == ctrl.projection.to_dict()
