"""The Grafana dashboard, generated from code: every panel and its PromQL in one table.

``torpor dashboard -o dashboards/torpor.json`` writes it; a test fails when the
committed file differs from :func:`render_dashboard`, and the Prometheus tests
run every panel's query against a real server scraping a real sleep/wake run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from torpor.statemachine.core.states import State
from torpor.telemetry.timeline import STATE_COLOURS

UID = "torpor-sleep"
TITLE = "torpor: sleep and wake"
#: Every query selects the dashboard's engine and rank variables. torpor's labels are
#: ``torpor_engine`` and ``torpor_rank`` (vLLM's own ``engine`` label is an index), the same on
#: torpor's Prometheus exporter and through OpenTelemetry's Prometheus translation.
SEL = 'torpor_engine=~"$engine", torpor_rank=~"$rank"'
RATE = "$__rate_interval"
BY_RANK = "torpor_engine, torpor_rank"
RANK_LEGEND = "{{torpor_engine}} rank {{torpor_rank}}"

#: The number each state is drawn as on the state timeline (its order in State), its name and colour.
STATE_CODES: tuple[tuple[int, str, str], ...] = tuple(
    (index, state.value, STATE_COLOURS[state]) for index, state in enumerate(State)
)


def _state_code_query() -> str:
    """One series per rank whose value is the code of the state it is in (torpor_state is 1 for that state only)."""
    parts = [f'(torpor_state{{{SEL}, state="{name}"}} == 1) * {code}' for code, name, _ in STATE_CODES]
    return f"max by ({BY_RANK}) ({' or '.join(parts)})"


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
    #: Value mappings: (value, text, colour) shown instead of the number.
    mappings: tuple[tuple[int, str, str], ...] = ()


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
        (Target(_state_code_query(), RANK_LEGEND),),
        "Which state each rank is in over time, one row per rank, in the colours of `torpor plot`.",
        width=24,
        height=7,
        mappings=STATE_CODES,
    ),
    Panel(
        "Last sleep and wake",
        "stat",
        "s",
        (
            Target(f"max by ({BY_RANK}) (torpor_last_sleep_duration_seconds{{{SEL}}})", f"sleep {RANK_LEGEND}"),
            Target(f"max by ({BY_RANK}) (torpor_last_wake_duration_seconds{{{SEL}}})", f"wake {RANK_LEGEND}"),
        ),
        "How long the last completed sleep and wake took, per rank (sleeps minutes apart leave the percentiles empty).",
        width=24,
        height=5,
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
        (Target(f"sum by ({BY_RANK}) (torpor_pinned_host_bytes{{{SEL}}})", RANK_LEGEND),),
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
        "Wake checks",
        "timeseries",
        "short",
        (
            Target(
                f"sum by (tag) (increase(torpor_wake_checked_bytes_total{{{SEL}}}[{RATE}]))",
                "{{tag}} bytes checked",
            ),
            Target(
                f'sum (increase(torpor_failures_total{{{SEL}, error_type="WakeCheckFailed"}}[{RATE}])) or vector(0)',
                "wakes rolled back: bytes differ",
            ),
        ),
        "Bytes of backups whose checksums matched at a wake, per tag, and wakes rolled back because restored "
        "bytes differed from the sleep's (WakeCheckFailed).",
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
                f"sum by (command, error_type) (increase(torpor_refusals_total{{{SEL}}}[{RATE}]))",
                "{{command}}: {{error_type}}",
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
                f"sum by (operation, error_type) (increase(torpor_failures_total{{{SEL}}}[{RATE}]))",
                "{{operation}}: {{error_type}}",
            ),
        ),
        "Sleeps aborted (rolled back) and wakes failed, by error class.",
    ),
    Panel(
        "Ranks",
        "table",
        "none",
        (Target(f"max by ({BY_RANK}, version, driver) (torpor_info{{{SEL}}})", instant=True),),
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
    if panel.mappings:
        out["fieldConfig"]["defaults"]["mappings"] = [
            {
                "type": "value",
                "options": {
                    str(value): {"text": text, "color": colour, "index": i}
                    for i, (value, text, colour) in enumerate(panel.mappings)
                },
            }
        ]
        out["fieldConfig"]["defaults"]["color"] = {"mode": "fixed", "fixedColor": "text"}
    if panel.kind == "state-timeline":
        out["options"].update({"mergeValues": True, "showValue": "auto", "rowHeight": 0.8, "alignValue": "left"})
    if panel.kind == "stat":
        out["options"].update(
            {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "none",
                "graphMode": "none",
                "textMode": "value_and_name",
                "orientation": "horizontal",
            }
        )
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
        "description": "Generated by `torpor dashboard` from torpor/telemetry/grafana.py; do not edit by hand.",
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
                _variable("engine", "label_values(torpor_info, torpor_engine)"),
                _variable("rank", 'label_values(torpor_info{torpor_engine=~"$engine"}, torpor_rank)'),
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
