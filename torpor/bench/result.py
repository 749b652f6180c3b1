"""One benchmark result: a system on a workload, its sleep and wake times, and its table row against the host-link floor."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from torpor.units import GiB


@dataclass
class Result:
    """One system on one workload."""

    system: str
    workload: str
    nbytes: int
    segments: int
    sleeps: list[float] = field(default_factory=list)
    wakes: list[float] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    host_held: int = 0
    exact: bool = True
    prepare_s: float = 0.0
    note: str = ""
    host_mode: str = ""
    pinned_awake: int = 0  # before the first sleep (after pinning ahead, when on)
    pinned_asleep: int = 0
    pinned_after_wake: int = 0  # once a release after wake is done

    def row(self, floor_d2h: float, floor_h2d: float) -> dict[str, Any]:
        """A table row: times and their ratio to the floor."""
        later_s = statistics.median(self.sleeps[1:]) if len(self.sleeps) > 1 else float("nan")
        wake_s = (
            statistics.median(self.wakes[1:])
            if len(self.wakes) > 1
            else (self.wakes[0] if self.wakes else float("nan"))
        )
        fs = self.nbytes / floor_d2h
        fw = self.nbytes / floor_h2d
        return {
            "system": self.system,
            "workload": self.workload,
            "GiB": self.nbytes / GiB,
            "segments": self.segments,
            "first_sleep_s": self.sleeps[0] if self.sleeps else float("nan"),
            "later_sleep_s": later_s,
            "wake_s": wake_s,
            "first_x": (self.sleeps[0] / fs) if self.sleeps else float("nan"),
            "later_x": later_s / fs,
            "wake_x": wake_s / fw,
            "first_wake_s": self.wakes[0] if self.wakes else float("nan"),  # may wait for a staged sleep's pins
            "first_wake_x": (self.wakes[0] / fw) if self.wakes else float("nan"),
            "released_pct": 100.0 * min(self.released or [0]) / self.nbytes if self.nbytes else 0.0,
            "host_GiB": self.host_held / GiB,
            "exact": self.exact,
            "prepare_s": self.prepare_s,
            "note": self.note,
            "host_mode": self.host_mode,
            "pinned_awake_GiB": self.pinned_awake / GiB,
            "pinned_asleep_GiB": self.pinned_asleep / GiB,
            "pinned_after_wake_GiB": self.pinned_after_wake / GiB,
        }
