"""A victim process for the crash tests: runs sleep/wake cycles on an event log until it is killed.

Usage: ``python tests/crash_worker.py LOG SEED [MAX_BYTES] [--no-fsync] [--catch-interrupts]``.
It opens a SleepController on LOG (recovering first when the log ends
mid-transition, as a restarted engine would), prints ``ready`` and then cycles
forever through level-1 and level-2 sleeps, selective and full wakes and
discards. Each memory step takes a little time so that a kill lands inside a
transition most of the time. ``--catch-interrupts``: a Ctrl-C (SIGINT) is
caught and the loop goes on, as an engine loop that catches
``KeyboardInterrupt`` does.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence

from torpor.errors import TorporError
from torpor.statemachine.core.protocol import Transfer
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.machine.controller import SleepController
from torpor.testing import FakeMemory

TAGS = {"weights": 4096, "kv_cache": 8192, "runtime": 1024, "workspace": 512}
STEP_SECONDS = 0.002


class SlowMemory(FakeMemory):
    """FakeMemory whose every step takes a couple of milliseconds, like a real copy would."""

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Back up, slowly."""
        time.sleep(STEP_SECONDS * len(tags))
        return super().backup(tags)

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Release, slowly."""
        time.sleep(STEP_SECONDS)
        return super().release(tags)

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Restore, slowly."""
        time.sleep(STEP_SECONDS)
        return super().restore(tags)


def main(argv: list[str]) -> int:
    """Open (and recover) the controller, say ready, cycle until killed."""
    flags = {a for a in argv[1:] if a.startswith("--")}
    args = [a for a in argv[1:] if not a.startswith("--")]
    path, seed = args[0], int(args[1])
    max_bytes = int(args[2]) if len(args) > 2 else 64 * 1024 * 1024
    rng = random.Random(seed)
    log = EventLog(path, fsync="--no-fsync" not in flags, max_bytes=max_bytes)
    ctrl = SleepController(SlowMemory(TAGS), log)
    if ctrl.projection.interrupted:
        ctrl.recover()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    catch = "--catch-interrupts" in flags
    while True:  # CPython checks for signals at a loop's jump back: the inner loop's jump is inside a try
        try:
            while True:
                try:
                    _cycle(ctrl, rng)
                except KeyboardInterrupt:
                    if not catch:
                        raise
        except KeyboardInterrupt:  # one landing in a handler, or at the inner loop's jump back
            if not catch:
                raise


def _cycle(ctrl: SleepController, rng: random.Random) -> None:
    """One sleep, perhaps a discard, one or two wakes; a refusal is a fact too (written to stderr)."""
    try:
        ctrl.sleep(rng.choice([1, 2]))
        if rng.random() < 0.2:
            ctrl.discard(["weights"])
        first = rng.choice([["weights"], ["kv_cache"], None])
        ctrl.wake(first)
        if first is not None:
            ctrl.wake()
    except TorporError as exc:
        sys.stderr.write(f"{exc}\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
