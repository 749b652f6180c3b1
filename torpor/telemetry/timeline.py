"""The timeline picture: bytes per tag by residency over time, with the state as coloured bands, from an event log.

Replays the log event by event (the same fold as the controller) and draws
three stacked-area panels sharing the time axis (on the GPU, on the host,
discarded), each stacked by tag, behind which every state the rank went
through is a band. Uses matplotlib's Agg backend; matplotlib is the ``plot`` extra.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from torpor.errors import BadEvent, NoEvents
from torpor.statemachine.core.events import Event
from torpor.statemachine.core.states import State
from torpor.statemachine.log.logsource import wall_problem
from torpor.statemachine.log.reader import read_events
from torpor.statemachine.projection.view import Projection

RESIDENCIES = (("resident", "on the GPU"), ("host", "on the host"), ("discarded", "discarded"))
STATE_COLOURS = {
    State.AWAKE: "#d9f0d3",
    State.SUSPENDING: "#fee391",
    State.ASLEEP_L1: "#c6dbef",
    State.ASLEEP_L2: "#9ecae1",
    State.PARTIALLY_AWAKE: "#e5d8f0",
    State.RESUMING: "#fdd0a2",
}


@dataclass
class Timeline:
    """Per-tag bytes by residency sampled at every event, and the state intervals."""

    engine: str = ""
    rank: int = 0
    times: list[float] = field(default_factory=list)
    bytes: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    states: list[tuple[float, float, State]] = field(default_factory=list)

    @property
    def tags(self) -> list[str]:
        """Every tag seen, sorted."""
        return sorted(self.bytes)


def timeline(events: Iterable[Event]) -> Timeline:
    """Fold ``events`` into a :class:`Timeline` (times in seconds since the first event)."""
    out = Timeline()
    proj = Projection()
    start: float | None = None
    state_start = 0.0
    for event in events:
        if start is None:
            start = event.wall
        now = event.wall - start
        before = proj.state
        proj.apply(event)
        if proj.state is not before or not out.times:
            if out.times:
                out.states.append((state_start, now, before))
            state_start = now
        out.times.append(now)
        for tag in proj.residency:
            if tag not in out.bytes:
                out.bytes[tag] = {r: [0] * (len(out.times) - 1) for r, _ in RESIDENCIES}
        for tag, series in out.bytes.items():
            usage = proj.residency.get(tag)
            for residency, _ in RESIDENCIES:
                series[residency].append(int(getattr(usage, residency)) if usage else 0)
    if out.times:
        out.states.append((state_start, out.times[-1], proj.state))
        out.engine, out.rank = proj.engine, proj.rank
    return out


def _unit(peak: int) -> tuple[float, str]:
    for scale, name in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if peak >= scale:
            return float(scale), name
    return 1.0, "bytes"


def plot(log: str | os.PathLike[str], output: str | os.PathLike[str], title: str | None = None) -> Path:
    """Draw the timeline of the event log at ``log`` into the PNG ``output``; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = list(read_events(log))
    problems = [p for p in map(wall_problem, events) if p is not None]
    if problems:  # a time axis from such a wall would be nonsense: the log is bad, say so
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        msg = f"{problems[0]}{more}; the log is bad, nothing plotted"
        raise BadEvent(msg)
    tl = timeline(events)
    if not tl.times:
        msg = f"{log} holds no events to plot"
        raise NoEvents(msg)
    peak = max(
        (sum(tl.bytes[t][r][i] for t in tl.tags) for r, _ in RESIDENCIES for i in range(len(tl.times))), default=0
    )
    scale, unit = _unit(peak)
    span = tl.times[-1] or 1.0
    times = [*tl.times, tl.times[-1] + span * 0.02]  # let the last step show
    cmap = plt.get_cmap("tab10")
    colours = {tag: cmap(i % 10) for i, tag in enumerate(tl.tags)}
    fig, axes = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True, constrained_layout=True)
    for ax, (residency, label) in zip(axes, RESIDENCIES, strict=True):
        for i, (begin, until, state) in enumerate(tl.states):
            end = times[-1] if i == len(tl.states) - 1 else max(until, begin + span * 0.002)
            ax.axvspan(begin, end, color=STATE_COLOURS[state], alpha=0.7, lw=0)
        ys = [[v / scale for v in [*tl.bytes[t][residency], tl.bytes[t][residency][-1]]] for t in tl.tags]
        if ys:
            ax.stackplot(times, ys, step="post", colors=[colours[t] for t in tl.tags], alpha=0.9, lw=0.5)
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_ylim(0, max(peak / scale * 1.1, 1e-9))
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xlabel("seconds since the first event")
    axes[-1].set_xlim(0, times[-1])
    tag_handles = [Patch(color=colours[t], label=t) for t in tl.tags]
    seen = [s for s in State if any(st is s for _, _, st in tl.states)]
    state_handles = [Patch(color=STATE_COLOURS[s], label=s.value) for s in seen]
    axes[0].legend(handles=tag_handles, title="tag", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    axes[1].legend(handles=state_handles, title="state", loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.suptitle(title or f"torpor timeline: {tl.engine or Path(log).stem} rank {tl.rank}")
    output = Path(output)
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output


#: The name the demo and other callers use.
plot_timeline = plot
