"""The Grafana dashboard, generated from code: every panel and its PromQL in one table.

``torpor dashboard -o dashboards/torpor.json`` writes it; a test fails when the
committed file differs from :func:`render_dashboard`, and the Prometheus tests
run every panel's query against a real server scraping a real sleep/wake run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

UID = "torpor-sleep"
TITLE = "torpor: sleep and wake"
SEL = 'engine=~"$engine", rank=~"$rank"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Target:
    """One query of a panel: PromQL, legend, and whether it is an instant (table) query."""

    expr: str
    legend: str = ""
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    """One panel: title, Grafana type, unit, width and height on the 24-column grid, queries."""

    title: str
    kind: str
    unit: str
    targets: tuple[Target, ...]
    description: str = ""
    width: int = 12
    height: int = 8
    stacked: bool = False


def _quantiles(metric: str, by: str, what: str) -> tuple[Target, ...]:
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{SEL}}}[{RATE}])))",
            f"p{round(q * 100)} {what} {{{{{by}}}}}",
        )
        for q in (0.5, 0.9, 0.99)
    )


PANELS: tuple[Panel, ...] = (
    Panel(
        "State",
        "state-timeline",
        "none",
        (Target(f"max by (engine, rank, state) (torpor_state{{{SEL}}}) == 1", "{{engine}} rank {{rank}}: {{state}}"),),
        "Which state each rank is in over time (awake, suspending, asleep_l1, asleep_l2, partially_awake, resuming).",
        width=24,
        height=7,
    ),
    Panel(
        "Bytes per tag by residency",
        "timeseries",
        "bytes",
        (Target(f"sum by (tag, residency) (torpor_tag_bytes{{{SEL}}})", "{{tag}} {{residency}}"),),
        "Bytes of each memory tag on the GPU (resident), backed up on the host (host), or gone (discarded).",
        stacked=True,
    ),
    Panel(
        "Pinned host memory",
        "timeseries",
        "bytes",
        (Target(f"sum by (engine, rank) (torpor_pinned_host_bytes{{{SEL}}})", "{{engine}} rank {{rank}}"),),
        "Pinned host memory held for backups, per rank.",
    ),
    Panel(
        "Sleep latency",
        "timeseries",
        "s",
        _quantiles("torpor_sleep_duration_seconds", "level", "level"),
        "Percentiles of completed sleep durations, by level.",
    ),
    Panel(
        "Wake latency",
        "timeseries",
        "s",
        _quantiles("torpor_wake_duration_seconds", "tags", "tags"),
        "Percentiles of completed wake durations, by woken tags.",
    ),
    Panel(
        "Transfer bandwidth",
        "timeseries",
        "Bps",
        (
            Target(
                f"sum by (tag, direction) (rate(torpor_tag_transfer_bytes_total{{{SEL}}}[{RATE}]))"
                f" / sum by (tag, direction) (rate(torpor_tag_transfer_seconds_total{{{SEL}}}[{RATE}]))",
                "{{tag}} {{direction}}",
            ),
        ),
        "Bytes per second of copy time, per tag and direction (the host link while it copies).",
    ),
    Panel(
        "Bytes moved",
        "timeseries",
        "Bps",
        (
            Target(
                f"sum by (direction) (rate(torpor_tag_transfer_bytes_total{{{SEL}}}[{RATE}]))",
                "{{direction}}",
            ),
        ),
        "Average bytes copied per second of wall time, by direction.",
    ),
    Panel(
        "Transition rate",
        "timeseries",
        "ops",
        (
            Target(
                f"sum by (from_state, to_state) (rate(torpor_transitions_total{{{SEL}}}[{RATE}]))",
                "{{from_state}} → {{to_state}}",
            ),
        ),
        "State transitions per second.",
    ),
    Panel(
        "Refusals",
        "timeseries",
        "short",
        (
            Target(
                f"sum by (command, reason) (increase(torpor_refusals_total{{{SEL}}}[{RATE}]))",
                "{{command}}: {{reason}}",
            ),
        ),
        "Commands the guard refused, by command and error class.",
    ),
    Panel(
        "Failed sleeps and wakes",
        "timeseries",
        "short",
        (
            Target(
                f"sum by (operation, reason) (increase(torpor_failures_total{{{SEL}}}[{RATE}]))",
                "{{operation}}: {{reason}}",
            ),
        ),
        "Sleeps aborted (rolled back) and wakes failed, by error class.",
    ),
    Panel(
        "Ranks",
        "table",
        "none",
        (Target(f"max by (engine, rank, version, driver) (torpor_info{{{SEL}}})", instant=True),),
        "Every rank with its torpor version and memory driver.",
        width=24,
        height=6,
    ),
)


def _panel(index: int, panel: Panel, x: int, y: int) -> dict[str, Any]:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    custom: dict[str, Any] = {}
    if panel.kind == "timeseries":
        custom = {"fillOpacity": 60 if panel.stacked else 10, "lineWidth": 1, "showPoints": "never"}
        custom["stacking"] = {"mode": "normal" if panel.stacked else "none", "group": "A"}
    out: dict[str, Any] = {
        "id": index + 1,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": ds,
        "gridPos": {"x": x, "y": y, "w": panel.width, "h": panel.height},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": ds,
                "expr": t.expr,
                "legendFormat": t.legend,
                "instant": t.instant,
                "range": not t.instant,
                **({"format": "table"} if t.instant else {}),
            }
            for i, t in enumerate(panel.targets)
        ],
    }
    if panel.kind == "state-timeline":
        out["options"].update({"mergeValues": True, "showValue": "never", "rowHeight": 0.8})
    return out


def _variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 3,
    }


def dashboard() -> dict[str, Any]:
    """The dashboard as a dict (Grafana's JSON model)."""
    panels, x, y, row_height = [], 0, 0, 0
    for index, panel in enumerate(PANELS):
        if x + panel.width > 24:
            x, y, row_height = 0, y + row_height, 0
        panels.append(_panel(index, panel, x, y))
        x += panel.width
        row_height = max(row_height, panel.height)
    return {
        "uid": UID,
        "title": TITLE,
        "description": "Generated by `torpor dashboard` from torpor/telemetry/dashboard.py; do not edit by hand.",
        "tags": ["torpor", "vllm", "sleep"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "",
        "graphTooltip": 1,
        "panels": panels,
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                _variable("engine", "label_values(torpor_info, engine)"),
                _variable("rank", 'label_values(torpor_info{engine=~"$engine"}, rank)'),
            ]
        },
        "annotations": {"list": []},
    }


def render_dashboard() -> str:
    """The dashboard as the committed JSON text (sorted keys, two-space indent, final newline)."""
    return json.dumps(dashboard(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def queries() -> list[tuple[str, str]]:
    """``(panel title, expr)`` for every query of every panel (what the Prometheus tests run)."""
    return [(p.title, t.expr) for p in PANELS for t in p.targets]
