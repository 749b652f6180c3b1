"""One demo cycle: sleep at a level, wake (fully, selectively, or with a weight reload), check, tabulate."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torpor.demo.workload import DEMO_TAGS, Check, Workload
from torpor.errors import InvalidTransition
from torpor.statemachine import Event, SleepController
from torpor.statemachine.core.events import SleepCompleted, TagReleased, TagRestored, WakeCompleted
from torpor.textout import fmt_rate, fmt_seconds, table
from torpor.units import byte_size


@dataclass(frozen=True)
class CycleKind:
    """A way to sleep and wake: the level, the wakes in order, and whether weights are reloaded."""

    name: str
    level: int
    wakes: tuple[tuple[str, ...] | None, ...]
    reload_weights: bool = False


#: The cycles the demo runs, in turn: cycle i is ``CYCLE_KINDS[i % 3]``.
CYCLE_KINDS: tuple[CycleKind, ...] = (
    CycleKind("level 1 sleep, full wake", 1, (None,)),
    CycleKind("level 1 sleep, selective wake: weights, then kv_cache", 1, (("weights",), ("kv_cache",))),
    CycleKind("level 2 sleep, wake and reload weights", 2, (None,), reload_weights=True),
)


@dataclass
class TagRow:
    """What one cycle did to one tag."""

    released: int = 0
    action: str = ""
    restored: int = 0
    source: str = ""
    check: str = "-"


@dataclass
class CycleResult:
    """Everything the table of one cycle shows."""

    index: int
    kind: CycleKind
    path: list[str] = field(default_factory=list)
    tags: dict[str, TagRow] = field(default_factory=dict)
    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0
    offloaded: int = 0
    from_host: int = 0
    checks: list[Check] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    device_asleep: dict[str, int] = field(default_factory=dict)
    pinned: int = 0
    untagged: str = ""  # what the device's untagged memory is (the workload says)

    @property
    def exact(self) -> bool:
        """True when every check of the cycle was exact."""
        return bool(self.checks) and all(c.exact for c in self.checks)

    def take(self, event: Event, state: str) -> None:
        """Fold one controller event into the result."""
        if not self.path or self.path[-1] != state:
            self.path.append(state)
        match event.data:
            case TagReleased(tag=tag, bytes=nbytes, action=action):
                row = self.tags.setdefault(tag, TagRow())
                row.released, row.action = nbytes, action
            case TagRestored(source=source, tag=tag, bytes=nbytes) if source != "rollback":
                row = self.tags.setdefault(tag, TagRow())
                row.restored, row.source = nbytes, source
                if source == "host":
                    self.from_host += nbytes
            case SleepCompleted() as d:
                self.sleep_seconds += float(d.seconds)
                self.offloaded += d.offloaded
                self.pinned = d.pinned or 0
                if d.device:
                    self.device_asleep = {str(k): int(v) for k, v in d.device.items()}
            case WakeCompleted(seconds=seconds):
                self.wake_seconds += float(seconds)


def run_cycle(
    controller: SleepController,
    workload: Workload,
    index: int,
    kind: CycleKind,
    step: Callable[[str], None],
    dwell: float = 0.0,
) -> CycleResult:
    """Sleep and wake once as ``kind`` says, checking after each wake."""
    result = CycleResult(index, kind, path=[controller.state.value], untagged=workload.untagged)
    unsubscribe = controller.subscribe(lambda e: result.take(e, controller.state.value))
    try:
        step(f"sleep level {kind.level}")
        controller.sleep(kind.level)
        time.sleep(dwell)  # asleep: where an RL step would train, or another job would use the GPU
        if index == 1:
            try:
                with controller.capture("demo: a capture while asleep"):
                    pass
            except InvalidTransition as exc:
                result.refusals.append(f"capture while {controller.state.value}: {exc}")
        discarded = [t for t, r in result.tags.items() if r.action == "discard"]
        for wake in kind.wakes:
            step("wake " + ("all tags" if wake is None else ", ".join(wake)))
            before = set(controller.projection.asleep_tags())
            controller.wake(None if wake is None else list(wake))
            woken = sorted(before - set(controller.projection.asleep_tags()))
            reload = kind.reload_weights and "weights" in woken
            workload.prepare(woken, reload)
            step("check what woke")
            resident = controller.projection.resident_tags()
            refilled = [t for t in discarded if t != "weights" or not kind.reload_weights]
            reloaded = ["weights"] if kind.reload_weights else []
            check = workload.check(resident, refilled, reloaded)
            result.checks.append(check)
            result.labels.append("after wake " + ("all" if wake is None else ", ".join(wake)))
            for tag, verdict in check.per_tag.items():
                result.tags.setdefault(tag, TagRow()).check = verdict
    finally:
        unsubscribe()
    return result


def _tag_order(tags: list[str]) -> list[str]:
    known = [t for t in DEMO_TAGS if t in tags]
    return known + sorted(t for t in tags if t not in DEMO_TAGS)


def stays_line(result: CycleResult) -> str:
    """What stayed on the device while asleep (torpor's tags and the rest), and the pinned host memory."""
    d = result.device_asleep
    return (
        f"  asleep: the device kept {byte_size(d.get('in_use', 0))} in use: torpor tags {byte_size(d.get('tagged', 0))}, "
        f"untagged {byte_size(d.get('untagged', 0))} ({result.untagged or 'not torpor tags'}); "
        f"host pinned {byte_size(result.pinned)}"
    )


def render(result: CycleResult, total: int) -> str:
    """The table of one cycle."""
    verdict = "exact" if result.exact else "NOT EXACT"
    head = f"cycle {result.index}/{total}: {result.kind.name} -> {verdict}"
    rows = []
    sums = [0, 0, 0, 0]
    for tag in _tag_order(list(result.tags)):
        r = result.tags[tag]
        off = r.released if r.action == "offload" else 0
        disc = r.released if r.action == "discard" else 0
        sums = [sums[0] + r.released, sums[1] + off, sums[2] + disc, sums[3] + r.restored]
        rows.append(
            [
                tag,
                byte_size(r.released),
                byte_size(off),
                byte_size(disc),
                byte_size(r.restored),
                r.source or "-",
                r.check,
            ]
        )
    rows.append(["total", *(byte_size(s) for s in sums), "", ""])
    grid = table(["tag", "released", "offloaded", "discarded", "restored", "from", "check"], rows)
    timing = (
        f"  sleep {fmt_seconds(result.sleep_seconds)} ({fmt_rate(result.offloaded, result.sleep_seconds)} to host)"
        f"   wake {fmt_seconds(result.wake_seconds)} ({fmt_rate(result.from_host, result.wake_seconds)} from host)"
    )
    if result.index == 1:  # the default host-memory policy pins at the first sleep and keeps it (docs/allocator.md)
        timing += (
            "\n  (the first sleep also pins the host memory of its backup, which later sleeps reuse: it is slower)"
        )
    lines = [head, "  path  " + " -> ".join(result.path), grid, timing]
    lines += [stays_line(result)] if result.device_asleep else []
    lines += [f"  check {label}: {c.what}" for label, c in zip(result.labels, result.checks, strict=True)]
    lines += [f"  guard refused {r}" for r in result.refusals]
    return "\n".join(lines)
