"""A victim process for the crash tests: runs sleep/wake cycles on an event log until it is killed.

Usage: ``python tests/crash_worker.py LOG SEED [MAX_BYTES]``. It opens a
SleepController on LOG (recovering first when the log ends mid-transition, as a
restarted engine would), prints ``ready`` and then cycles forever through
level-1 and level-2 sleeps, selective and full wakes and discards. Each memory
step takes a little time so that a kill lands inside a transition most of the
time.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence

from torpor.errors import TorporError
from torpor.statemachine.controller import SleepController
from torpor.statemachine.logwriter import EventLog
from torpor.statemachine.protocol import Transfer
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
    path, seed = argv[1], int(argv[2])
    max_bytes = int(argv[3]) if len(argv) > 3 else 64 * 1024 * 1024
    rng = random.Random(seed)
    ctrl = SleepController(SlowMemory(TAGS), EventLog(path, fsync=True, max_bytes=max_bytes))
    if ctrl.projection.interrupted:
        ctrl.recover()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        try:
            ctrl.sleep(rng.choice([1, 2]))
            if rng.random() < 0.2:
                ctrl.discard(["weights"])
            first = rng.choice([["weights"], ["kv_cache"], None])
            ctrl.wake(first)
            if first is not None:
                ctrl.wake()
        except TorporError as exc:  # a refusal is a fact too; keep cycling
            sys.stderr.write(f"{exc}\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
