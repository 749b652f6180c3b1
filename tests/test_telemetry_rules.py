"""Tests for the operator kit in deploy/: Prometheus rules (promtool), the scrape config, Grafana provisioning."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from torpor.telemetry import METRICS
from torpor.telemetry.grafana import UID
from torpor.telemetry.samples import BASE_LABELS

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "torpor-rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "torpor-rules.test.yml"
SCRAPE = DEPLOY / "prometheus" / "prometheus.yml"
#: Series the rules read that torpor does not export: vLLM's own, and the host-memory policy's
#: (torpor_host_budget_bytes, torpor_asleep_device_bytes, exported with the host budget work).
OTHERS = {"vllm:engine_sleep_state", "torpor_host_budget_bytes", "torpor_asleep_device_bytes"}


def _load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool is not None
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120, check=False, cwd=RULES.parent)


@pytest.mark.prometheus
def test_rules_pass_promtool_check_and_their_unit_tests() -> None:
    """promtool check rules accepts the rules and promtool test rules passes every alert and recording test."""
    checked = _promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = _promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


@pytest.mark.prometheus
def test_scrape_config_is_valid_and_loads_the_rules() -> None:
    """promtool check config accepts the shipped prometheus.yml, including the rule file it loads."""
    done = _promtool("check", "config", SCRAPE.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout


def _exprs() -> list[tuple[str, str]]:
    rules = [r for group in _load(RULES)["groups"] for r in group["rules"]]
    return [(r.get("alert") or r["record"], r["expr"]) for r in rules]


def test_rules_cover_the_promised_alerts() -> None:
    """Stuck in suspending/resuming, failures, pinned host over budget, device memory while asleep: one alert each."""
    alerts = {r["alert"]: r for g in _load(RULES)["groups"] for r in g["rules"] if "alert" in r}
    assert set(alerts) == {
        "TorporStuckInTransition",
        "TorporSleepOrWakeFailures",
        "TorporPinnedHostOverBudget",
        "TorporDeviceMemoryInUseWhileAsleep",
    }
    assert all(a["labels"]["severity"] in ("warning", "critical") for a in alerts.values())
    assert all({"summary", "description"} <= set(a["annotations"]) for a in alerts.values())
    tested = {t["alertname"] for test in _load(RULE_TESTS)["tests"] for t in test.get("alert_rule_test", [])}
    assert tested == set(alerts)


def _metrics_in(expr: str) -> set[str]:
    """Metric names in a PromQL expression (strings, label matchers and label lists removed first)."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    return set(re.findall(r"\b(?:torpor|vllm)[a-zA-Z0-9_:]*", text))


def test_rules_read_only_metrics_and_labels_that_exist() -> None:
    """Every metric a rule reads is torpor's (or vLLM's), and engine and rank are torpor_engine and torpor_rank."""
    recorded = {name for name, _ in _exprs() if ":" in name}
    labels = {*BASE_LABELS, "job", "instance", "engine"} | {
        label for _, extra, _ in METRICS.values() for label in extra
    }
    for name, expr in _exprs():
        found = _metrics_in(expr)
        assert found, (name, expr)
        for metric in found:
            assert metric in METRICS or metric in OTHERS or metric in recorded, (name, metric)
        for group in re.findall(r"\b(?:by|on)\s*\(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",") if x.strip()):
                assert label in labels, (name, label)
        matchers = " ".join(re.findall(r"\{([^}]*)\}", expr))
        assert not re.search(r"(?<![a-z_])(engine|rank)\s*=", matchers), (name, expr)  # vLLM's engine is an index


def test_grafana_provisioning_matches_the_dashboard_and_prometheus() -> None:
    """The datasource is a default Prometheus whose timeInterval is the scrape interval; the provider loads a folder."""
    (source,) = _load(DEPLOY / "grafana" / "provisioning" / "datasources" / "torpor.yml")["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    scrape = _load(SCRAPE)["global"]["scrape_interval"]
    assert source["jsonData"]["timeInterval"] == scrape
    (provider,) = _load(DEPLOY / "grafana" / "provisioning" / "dashboards" / "torpor.yml")["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].startswith("/")
    docs = (ROOT / "docs" / "telemetry.md").read_text()
    assert provider["options"]["path"] in docs  # the docs say where to put dashboards/torpor.json
    assert UID in (ROOT / "dashboards" / "torpor.json").read_text()


def test_the_documented_vllm_join_queries_are_the_tested_ones() -> None:
    """Each PromQL query docs/telemetry.md shows for the join with vLLM is one promtool's rule tests evaluate."""
    docs = (ROOT / "docs" / "telemetry.md").read_text()
    blocks = re.findall(r"```promql\n(.*?)```", docs, re.DOTALL)
    assert blocks
    queries = [
        " ".join(q.split())
        for block in blocks
        for q in re.split(r"\n\s*\n", re.sub(r"^#.*$", "", block, flags=re.MULTILINE))
        if q.strip()
    ]
    tested = {
        " ".join(t["expr"].split()) for test in _load(RULE_TESTS)["tests"] for t in test.get("promql_expr_test", [])
    }
    assert len(queries) >= 2
    for query in queries:
        assert query in tested, query
