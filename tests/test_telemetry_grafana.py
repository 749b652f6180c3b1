"""Tests for torpor.telemetry.grafana: the committed Grafana JSON is current, and every panel query works on a real Prometheus."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import real_prometheus

from torpor import SleepController
from torpor.cli import main
from torpor.errors import TorporError
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.protocol import Transfer
from torpor.telemetry import METRICS, Server, serve
from torpor.telemetry.grafana import STATE_CODES, dashboard, render_dashboard
from torpor.telemetry.timeline import STATE_COLOURS
from torpor.testing import FakeMemory
from torpor.units import GiB

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "dashboards" / "torpor.json"
LINK = 55e9  # bytes per second the simulated host link copies at


def panel_queries(model: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of the dashboard model."""
    return [(p["title"], t["expr"]) for p in model["panels"] for t in p["targets"]]


def substitute(expr: str) -> str:
    """Replace Grafana's variables the way Grafana would for 'All' over a short range."""
    return expr.replace("$engine", ".*").replace("$rank", ".*").replace("$__rate_interval", "1m")


def test_committed_dashboard_is_current() -> None:
    """dashboards/torpor.json is exactly what the code generates (run `torpor dashboard -o dashboards/torpor.json`)."""
    assert COMMITTED.read_text() == render_dashboard()


def test_cli_writes_and_prints_the_dashboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`torpor dashboard -o FILE` writes the generated JSON; without -o it prints it."""
    out = tmp_path / "sub" / "d.json"
    assert main(["dashboard", "-o", str(out)]) == 0
    assert out.read_text() == render_dashboard()
    assert main(["dashboard"]) == 0
    assert json.loads(capsys.readouterr().out)["uid"] == dashboard()["uid"]


def test_dashboard_has_the_required_panels_and_variables() -> None:
    """State timeline, stacked bytes, latency percentiles, bandwidth, refusals, transitions; engine and rank variables."""
    model = dashboard()
    titles = {p["title"]: p for p in model["panels"]}
    assert titles["State"]["type"] == "state-timeline"
    assert titles["Bytes per tag by residency"]["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    for title in ("Sleep latency", "Wake latency"):
        exprs = [t["expr"] for t in titles[title]["targets"]]
        assert [e.split(",")[0] for e in exprs] == [f"histogram_quantile({q}" for q in ("0.5", "0.9", "0.99")]
    for title in ("Transfer bandwidth", "Refusals", "Transition rate"):
        assert title in titles
    names = [v["name"] for v in model["templating"]["list"]]
    assert names == ["datasource", "engine", "rank"]
    assert titles["Last sleep and wake"]["type"] == "stat"
    assert len({p["id"] for p in model["panels"]}) == len(model["panels"])
    assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in model["panels"])


def test_state_timeline_maps_each_state_to_its_plot_colour() -> None:
    """The state timeline shows one row per rank, each state by name in the colour `torpor plot` gives it."""
    panel = next(p for p in dashboard()["panels"] if p["title"] == "State")
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    shown = {int(v): (o["text"], o["color"]) for v, o in mapping["options"].items()}
    assert shown == {code: (state.value, STATE_COLOURS[state]) for code, (state) in enumerate(STATE_COLOURS)}
    assert [name for _, name, _ in STATE_CODES] == [s.value for s in STATE_COLOURS]
    assert panel["targets"][0]["expr"].startswith("max by (torpor_engine, torpor_rank) (")


def test_every_query_uses_known_metrics_and_both_variables() -> None:
    """Each panel query filters on $engine and $rank and names only metrics torpor exposes."""
    known = set(METRICS)
    for title, expr in panel_queries(dashboard()):
        assert 'torpor_engine=~"$engine"' in expr, title
        assert 'torpor_rank=~"$rank"' in expr, title
        rest = re.sub(r"torpor_engine|torpor_rank|\$engine|\$rank", "", expr)
        assert not re.search(r"\b(engine|rank)\b", rest), (title, expr)  # vLLM's `engine` label is an index
        for name in re.findall(r"(torpor_[a-z_]+)\{", expr):  # metric names (labels are followed by =)
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert name in known or base in known, (title, name)


# -- against a real Prometheus ----------------------------------------------------


class TimedMemory(FakeMemory):
    """FakeMemory whose copies take (simulated) time at host-link speed, so bandwidth is finite."""

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Back up, reporting bytes / LINK seconds."""
        return {t: Transfer(t, x.bytes, x.bytes / LINK, offloaded=True) for t, x in super().backup(tags).items()}

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Restore, reporting bytes / LINK seconds, and every byte of a backup checked (as torpor's allocator does)."""
        done = super().restore(tags)
        return {
            t: Transfer(
                t,
                x.bytes,
                x.bytes / LINK if x.offloaded else 0.0,
                offloaded=x.offloaded,
                checked=x.bytes if x.offloaded else 0,
            )
            for t, x in done.items()
        }


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback test server
        return json.loads(response.read())


def _activity(controller: SleepController, memory: FakeMemory, seconds: float) -> None:
    """Sleep/wake cycles, a refusal and a failed wake, spread over ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        controller.sleep(1)
        with pytest.raises(TorporError):
            controller.sleep(1)
        controller.wake(["weights"])
        time.sleep(0.1)
        controller.wake(["kv_cache"])
        controller.sleep(2)
        memory.fail_once("restore", "runtime")
        with pytest.raises(TorporError):
            controller.wake()
        controller.wake()
        time.sleep(0.2)


@dataclass
class Run:
    """The Prometheus fixture: its URL, the endpoint it scrapes, and the controller that ran."""

    url: str
    server: Server
    controller: SleepController


def _wait_for_a_scrape_after(url: str, wall: float, deadline: float) -> None:
    """Wait until Prometheus holds a sample scraped after ``wall`` (Unix time): it then shows the run's final values.

    Prometheus scrapes every second; reading right after the last transition reads the scrape
    before it. A sample's timestamp is its scrape's start, so one newer than ``wall`` saw it all.
    """
    while True:
        result = _instant(url, 'max(timestamp(torpor_info{torpor_engine="e2e"}))')
        if result and float(result[0]["value"][1]) > wall:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"no scrape after {wall} within the deadline: {result}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """A real Prometheus on loopback scraping a torpor endpoint every second during a sleep/wake run."""
    tmp = tmp_path_factory.mktemp("prometheus")
    memory = TimedMemory({"weights": 16 * GiB, "kv_cache": 40 * GiB, "cudagraph": GiB // 2, "runtime": GiB // 4})
    controller = SleepController(memory, engine="e2e", rank=0)
    server = serve(controller, 0)
    try:
        with real_prometheus(tmp, server.port) as (url, proc):
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(url + "/-/ready", timeout=2):  # noqa: S310
                        break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        pytest.fail(f"prometheus did not start: {(tmp / 'prometheus.log').read_text()[-2000:]}")
                    time.sleep(0.1)
            # Prometheus applies new scrape targets only every 5 s: wait for the first scrape, then act.
            while not [t for t in _get(url + "/api/v1/targets")["data"]["activeTargets"] if t["health"] == "up"]:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"prometheus never scraped the endpoint: {(tmp / 'prometheus.log').read_text()[-2000:]}"
                    )
                time.sleep(0.1)
            _activity(controller, memory, 3.5)
            _wait_for_a_scrape_after(url, time.time(), time.monotonic() + 30)
            yield Run(url, server, controller)
    finally:
        server.close()


def _instant(url: str, expr: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr})
    body = _get(f"{url}/api/v1/query?{query}")
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.mark.prometheus
def test_every_panel_query_returns_data_from_a_real_prometheus(prometheus: Run) -> None:
    """Each dashboard query, run through Prometheus's HTTP API, returns at least one finite value."""
    url = prometheus.url
    queries = panel_queries(json.loads(COMMITTED.read_text()))
    missing: dict[str, str] = {}
    deadline = time.monotonic() + 20
    while True:
        missing = {}
        for title, expr in queries:
            result = _instant(url, substitute(expr))
            values = [float(r["value"][1]) for r in result]
            if not any(math.isfinite(v) for v in values):
                missing[title] = f"{substitute(expr)} -> {result}"
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, missing


@pytest.mark.prometheus
def test_panel_values_match_the_run(prometheus: Run) -> None:
    """What Prometheus scraped agrees with the run: the final state, bytes by residency, bandwidth near the link speed."""
    url = prometheus.url
    awake = _instant(url, 'torpor_state{torpor_engine="e2e", state="awake"}')
    assert [float(r["value"][1]) for r in awake] == [1.0]
    resident = _instant(url, 'sum(torpor_tag_bytes{torpor_engine="e2e", residency="resident"})')
    assert float(resident[0]["value"][1]) == 16 * GiB + 40 * GiB + GiB // 2 + GiB // 4
    bandwidth = _instant(
        url,
        "sum(rate(torpor_tag_transfer_bytes_total[1m])) / sum(rate(torpor_tag_transfer_seconds_total[1m]))",
    )
    assert float(bandwidth[0]["value"][1]) == pytest.approx(LINK, rel=1e-6)


@pytest.mark.prometheus
def test_dashboard_variables_resolve(prometheus: Run) -> None:
    """The engine and rank variables' label_values queries find the scraped engine and rank."""
    url = prometheus.url
    match = urllib.parse.urlencode({"match[]": "torpor_info"})
    assert "e2e" in _get(f"{url}/api/v1/label/torpor_engine/values?{match}")["data"]
    assert "0" in _get(f"{url}/api/v1/label/torpor_rank/values?{match}")["data"]


def _panel_values(title: str, url: str) -> list[float]:
    panel = next(p for p in dashboard()["panels"] if p["title"] == title)
    return [float(r["value"][1]) for t in panel["targets"] for r in _instant(url, substitute(t["expr"]))]


@pytest.mark.prometheus
def test_state_and_last_duration_panels_match_the_run(prometheus: Run) -> None:
    """The state timeline shows the code mapped to 'awake'; the last sleep/wake panel shows the last events' seconds."""
    awake = next(code for code, name, _ in STATE_CODES if name == "awake")
    assert _panel_values("State", prometheus.url) == [awake]
    events = prometheus.controller.events(0)
    sleep = next(e for e in reversed(events) if e.kind is EventKind.SLEEP_COMPLETED)
    wake = next(e for e in reversed(events) if e.kind is EventKind.WAKE_COMPLETED)
    assert _panel_values("Last sleep and wake", prometheus.url) == [
        pytest.approx(sleep.data["seconds"]),
        pytest.approx(wake.data["seconds"]),
    ]
