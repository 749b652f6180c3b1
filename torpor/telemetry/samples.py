"""torpor's metric families and a rank's samples: what every sink exposes, computed from a rank's projection and stats.

:data:`METRICS` names each family once (type, extra labels, help); the
Prometheus collector (:mod:`torpor.telemetry.prometheus`), the OpenTelemetry
sink (:mod:`torpor.telemetry.otel`) and multiprocess mode
(:mod:`torpor.telemetry.multiprocess`) all read it. :func:`rank_samples` is one
rank's samples now, as named :class:`Sample` records: gauges from the live
projection (and a keeper backing's figures, read now), counters and histograms
from the tracker's accumulated :class:`~torpor.telemetry.rankstats.RankStats`.
"""

from __future__ import annotations

from typing import NamedTuple

from torpor.statemachine.core.states import State
from torpor.telemetry.rankstats import RankStats
from torpor.telemetry.tracker import HostBacking, Tracker, host_backing, keeper_figures

#: The residencies of a tag's bytes (the ``residency`` label of ``torpor_tag_bytes``).
RESIDENCIES: tuple[str, ...] = ("resident", "host", "discarded")
#: The labels of every series: the engine's name and the rank (vLLM's ``engine`` label is its engine index).
BASE_LABELS: tuple[str, ...] = ("torpor_engine", "torpor_rank")

#: Every metric family torpor exposes: name (as exposed) -> (type, extra labels, help).
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "torpor_info": ("info", ("version", "driver"), "torpor version and the memory driver (memory class) of each rank"),
    "torpor_state": ("gauge", ("state",), "Current sleep state: 1 for the state the rank is in, 0 for the others"),
    "torpor_state_since_timestamp_seconds": (
        "gauge",
        (),
        "Unix time at which the rank entered its current state",
    ),
    "torpor_tag_bytes": (
        "gauge",
        ("tag", "residency"),
        "Bytes of each memory tag by residency (resident, host, discarded)",
    ),
    "torpor_tag_kept_bytes": (
        "gauge",
        ("tag",),
        "Bytes of a discarded tag kept on the host while it sleeps: tracked state no reload restores (track())",
    ),
    "torpor_pinned_host_bytes": ("gauge", (), "Pinned host memory held for backups"),
    "torpor_last_sleep_duration_seconds": ("gauge", (), "Duration of the last completed sleep"),
    "torpor_last_wake_duration_seconds": ("gauge", (), "Duration of the last completed wake"),
    "torpor_host_budget_bytes": (
        "gauge",
        (),
        "Pinned host memory the host-memory policy lets backups hold (+Inf: no budget)",
    ),
    "torpor_asleep_device_bytes": (
        "gauge",
        ("part",),
        "Device memory in use at the last sleep: in_use, tagged (torpor's tags still mapped), "
        "untagged (CUDA context, libraries, torch's default pool)",
    ),
    "torpor_cudagraphs": ("gauge", (), "CUDA graphs captured into the graph pool and not released"),
    "torpor_transitions_total": (
        "counter",
        ("from_state", "to_state"),
        "State transitions, by source and target state",
    ),
    "torpor_sleep_duration_seconds": ("histogram", ("level",), "Duration of completed sleeps, by level"),
    "torpor_wake_duration_seconds": (
        "histogram",
        ("tags",),
        "Duration of completed wakes, by woken tags (all, or the named tags)",
    ),
    "torpor_tag_transfer_bytes_total": (
        "counter",
        ("tag", "direction"),
        "Bytes copied per tag between device and host",
    ),
    "torpor_tag_transfer_seconds_total": (
        "counter",
        ("tag", "direction"),
        "Seconds spent copying per tag between device and host",
    ),
    "torpor_wake_checked_bytes_total": (
        "counter",
        ("tag",),
        "Bytes of host backups checked at wakes (checksums equal to the sleep's), per tag",
    ),
    "torpor_refusals_total": (
        "counter",
        ("command", "error_type"),
        "Commands refused by the guard, by command and error class",
    ),
    "torpor_failures_total": (
        "counter",
        ("operation", "error_type"),
        "Sleeps aborted and wakes failed, by error class",
    ),
    "torpor_events_total": ("counter", ("kind",), "Events recorded, by kind"),
    # a keeper backing the allocator's host memory (torpor.keeper; docs/keeper.md): keeper_engine is its name there
    "torpor_keeper_host_bytes": (
        "gauge",
        ("keeper_engine",),
        "Host backup bytes held in keeper regions mapped into this rank",
    ),
    "torpor_keeper_backup_bytes": ("gauge", ("keeper_engine",), "Bytes of the backup published to the keeper now"),
    "torpor_keeper_up": ("gauge", ("keeper_engine",), "1 while the keeper answers this rank, 0 once it is gone"),
    "torpor_keeper_fallbacks_total": (
        "counter",
        ("keeper_engine",),
        "Host ranges left in the rank's own memory (keeper gone or over budget)",
    ),
    "torpor_keeper_adopted_bytes_total": (
        "counter",
        ("keeper_engine",),
        "Bytes adopted from a keeper's backup (backup_adopted events)",
    ),
    "torpor_keeper_adoptions_total": ("counter", ("keeper_engine",), "Backups adopted from a keeper"),
}


#: Counters the tracker accumulates: its metric -> the family.
COUNTERS = {
    "transition": "torpor_transitions_total",
    "transfer_bytes": "torpor_tag_transfer_bytes_total",
    "transfer_seconds": "torpor_tag_transfer_seconds_total",
    "checked_bytes": "torpor_wake_checked_bytes_total",
    "refusal": "torpor_refusals_total",
    "failure": "torpor_failures_total",
    "event": "torpor_events_total",
    "adopted_bytes": "torpor_keeper_adopted_bytes_total",
    "adoption": "torpor_keeper_adoptions_total",
}
#: Histograms the tracker accumulates: its metric -> the family.
HISTOGRAMS = {"sleep_seconds": "torpor_sleep_duration_seconds", "wake_seconds": "torpor_wake_duration_seconds"}
#: Gauges of the last completed sleep and wake (the tracker keeps the values; none before the first one).
LAST_GAUGES = {
    "sleep_seconds": "torpor_last_sleep_duration_seconds",
    "wake_seconds": "torpor_last_wake_duration_seconds",
}


class Sample(NamedTuple):
    """One sample of a rank, as :func:`rank_samples` computes it."""

    family: str  #: the metric family it belongs to (a key of :data:`METRICS`)
    name: str  #: the sample's own name (``<family>_bucket``, ``_count``, ``_sum`` for a histogram)
    labels: tuple[tuple[str, str], ...]  #: sorted (label, value) pairs, the engine and rank among them
    value: float
    prefix: str  #: its ``name{labels} `` text, the line before the value


#: Per-rank memo of each series' labels and line prefix, keyed by (sample name, extra labels).
SeriesCache = dict[tuple[str, tuple[tuple[str, str], ...]], tuple[tuple[tuple[str, str], ...], str]]


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def keeper_key(backing: HostBacking | None) -> tuple[object, ...]:
    """What a rank's keeper samples depend on (part of the collector's cache key: they change between events)."""
    return () if backing is None else (id(backing), backing.engine, *keeper_figures(backing))


def rank_samples(tracker: Tracker, stats: RankStats, version: str, series: SeriesCache | None = None) -> list[Sample]:
    """Every sample of one rank: gauges from the live projection, counters and histograms from ``stats``.

    With a keeper backing the memory's host arena (:func:`~torpor.telemetry.tracker.host_backing`), its
    ``torpor_keeper_*`` figures, read now.

    ``series`` memoises each series' sorted labels and line prefix across scrapes (a rank's series are few).
    """
    proj = tracker.source.projection
    base = ((BASE_LABELS[0], tracker.engine), (BASE_LABELS[1], str(tracker.rank)))
    out: list[Sample] = []
    memo: SeriesCache = {} if series is None else series

    def add(family: str, name: str, extra: tuple[tuple[str, str], ...], value: float) -> None:
        known = memo.get((name, extra))
        if known is None:
            labels = tuple(sorted(base + extra))
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            known = memo[(name, extra)] = (labels, f"{name}{{{text}}} ")
        out.append(Sample(family, name, known[0], value, known[1]))

    add("torpor_info", "torpor_info", (("driver", tracker.driver), ("version", version)), 1.0)
    current = proj.state
    for state in State:
        add("torpor_state", "torpor_state", (("state", state.value),), 1.0 if state is current else 0.0)
    add("torpor_state_since_timestamp_seconds", "torpor_state_since_timestamp_seconds", (), proj.since_wall)
    for tag, usage in sorted(dict(proj.residency).items()):
        for residency in RESIDENCIES:
            value = float(getattr(usage, residency))
            add("torpor_tag_bytes", "torpor_tag_bytes", (("residency", residency), ("tag", tag)), value)
    for tag, nbytes in sorted(proj.kept.items()):
        add("torpor_tag_kept_bytes", "torpor_tag_kept_bytes", (("tag", tag),), float(nbytes))
    add("torpor_pinned_host_bytes", "torpor_pinned_host_bytes", (), float(proj.pinned_bytes))
    for metric, family in LAST_GAUGES.items():
        last = tracker.last.get(metric)
        if last is not None:
            add(family, family, (), last)
    budget = proj.host_policy.get("budget_bytes")
    add("torpor_host_budget_bytes", "torpor_host_budget_bytes", (), float("inf") if budget is None else float(budget))
    for part in ("in_use", "tagged", "untagged"):
        if part in proj.device_asleep:
            value = float(proj.device_asleep[part])
            add("torpor_asleep_device_bytes", "torpor_asleep_device_bytes", (("part", part),), value)
    add("torpor_cudagraphs", "torpor_cudagraphs", (), float(proj.graph_count))
    backing = host_backing(tracker.source)
    if backing is not None:
        for family, value in keeper_figures(backing):
            add(family, family, (("keeper_engine", backing.engine),), value)
    counters, hists = stats.snapshot()
    for metric, family in COUNTERS.items():
        names = METRICS[family][1]
        for labels, value in sorted(counters.get(metric, {}).items()):
            add(family, family, tuple(zip(names, labels, strict=True)), value)
    for metric, family in HISTOGRAMS.items():
        names = METRICS[family][1]
        for labels, hist in sorted(hists.get(metric, {}).items()):
            extra = tuple(zip(names, labels, strict=True))
            for le, count in hist.buckets():
                add(family, f"{family}_bucket", (*extra, ("le", le)), count)
            add(family, f"{family}_count", extra, float(sum(hist.counts)))
            add(family, f"{family}_sum", extra, hist.total)
    return out
