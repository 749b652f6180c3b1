"""Tests for torpor.telemetry.otel: spans per sleep, wake and tag, refusal events, metrics, through the SDK in memory."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import RigMaker

from torpor import HostMemoryPolicy, Policy, SleepController
from torpor.errors import InvalidTransition, MemoryOperationFailed
from torpor.telemetry import METRICS, attach
from torpor.telemetry.otel import OTEL_INSTRUMENTS, otel_instrument
from torpor.telemetry.rankstats import DURATION_BUCKETS
from torpor.telemetry.samples import BASE_LABELS
from torpor.testing import FakeMemory

TAGS = {"weights": 4000, "kv_cache": 8000, "cudagraph": 300, "runtime": 50}


@pytest.fixture
def otel() -> tuple[TracerProvider, InMemorySpanExporter, MeterProvider, InMemoryMetricReader]:
    """SDK providers with in-memory exporter and reader."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    return tracer_provider, exporter, meter_provider, reader


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Data points by metric name from one collection."""
    data = reader.get_metrics_data()
    out: dict[str, list[Any]] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def test_sleep_is_a_span_with_a_child_per_tag(otel: Any) -> None:
    """A sleep gives a torpor.sleep span and one torpor.sleep.tag child per tag with bytes and action."""
    tracer_provider, exporter, meter_provider, _ = otel
    controller = SleepController(FakeMemory(TAGS), engine="e", rank=1)
    attach(controller, tracer_provider=tracer_provider, meter_provider=meter_provider, prometheus=False)
    controller.sleep(1)
    spans = exporter.get_finished_spans()
    parent = next(s for s in spans if s.name == "torpor.sleep")
    children = [s for s in spans if s.name == "torpor.sleep.tag"]
    assert parent.attributes is not None
    assert parent.attributes["torpor.level"] == 1
    assert parent.attributes["torpor.rank"] == 1
    assert parent.attributes["torpor.freed"] == sum(TAGS.values())
    assert {c.attributes["torpor.tag"]: c.attributes["torpor.action"] for c in children if c.attributes} == {
        "weights": "offload",
        "kv_cache": "discard",
        "cudagraph": "offload",
        "runtime": "offload",
    }
    assert all(c.parent is not None and c.parent.span_id == parent.context.span_id for c in children)
    assert all(c.context.trace_id == parent.context.trace_id for c in children)
    weights = next(c for c in children if c.attributes and c.attributes["torpor.tag"] == "weights")
    assert weights.attributes is not None
    assert weights.attributes["torpor.bytes"] == 4000
    assert "torpor.backup_seconds" in weights.attributes
    assert parent.start_time is not None
    assert parent.end_time is not None
    assert parent.start_time <= parent.end_time


def test_wake_span_children_are_the_restored_tags(otel: Any) -> None:
    """A partial wake's span names the woken tags and has a child for each tag it restored."""
    tracer_provider, exporter, meter_provider, _ = otel
    controller = SleepController(FakeMemory(TAGS))
    attach(controller, tracer_provider=tracer_provider, meter_provider=meter_provider, prometheus=False)
    controller.sleep(1)
    exporter.clear()
    controller.wake(["weights"])
    spans = exporter.get_finished_spans()
    wake = next(s for s in spans if s.name == "torpor.wake")
    assert wake.attributes is not None
    assert wake.attributes["torpor.tags"] == "weights"
    restored = {
        s.attributes["torpor.tag"]: s.attributes["torpor.source"]
        for s in spans
        if s.name == "torpor.wake.tag" and s.attributes
    }
    assert restored == {"weights": "host", "cudagraph": "host", "runtime": "host"}


def test_refusal_is_a_span_event(otel: Any) -> None:
    """A refused command outside a transition gives an error span named after it with a torpor.refused event."""
    tracer_provider, exporter, meter_provider, _ = otel
    controller = SleepController(FakeMemory(TAGS))
    attach(controller, tracer_provider=tracer_provider, meter_provider=meter_provider, prometheus=False)
    with pytest.raises(InvalidTransition):
        controller.wake()
    (span,) = exporter.get_finished_spans()
    assert span.name == "torpor.wake"
    assert span.status.status_code is StatusCode.ERROR
    (event,) = span.events
    assert event.name == "torpor.refused"
    assert event.attributes is not None
    assert event.attributes["error.type"] == "InvalidTransition"
    assert event.attributes["torpor.state"] == "awake"


def test_failed_wake_ends_its_span_with_an_error(otel: Any) -> None:
    """A wake that fails is an error span with the rollback as an event."""
    tracer_provider, exporter, meter_provider, _ = otel
    memory = FakeMemory(TAGS)
    controller = SleepController(memory)
    attach(controller, tracer_provider=tracer_provider, meter_provider=meter_provider, prometheus=False)
    controller.sleep(1)
    memory.fail_once("restore", "weights")
    with pytest.raises(MemoryOperationFailed):
        controller.wake()
    wake = next(s for s in exporter.get_finished_spans() if s.name == "torpor.wake")
    assert wake.status.status_code is StatusCode.ERROR
    assert wake.attributes is not None
    assert wake.attributes["error.type"] == "MemoryOperationFailed"
    assert [e.name for e in wake.events] and all(e.name == "torpor.rolled_back" for e in wake.events)


def test_metrics_gauges_and_histograms(otel: Any) -> None:
    """Observable gauges report bytes per tag and residency; histograms count sleeps and wakes."""
    tracer_provider, _, meter_provider, reader = otel
    controller = SleepController(FakeMemory(TAGS), engine="e", rank=0)
    attach(controller, tracer_provider=tracer_provider, meter_provider=meter_provider, prometheus=False)
    controller.sleep(1)
    controller.wake()
    with pytest.raises(InvalidTransition):
        controller.wake()
    points = metric_points(reader)
    resident = {
        p.attributes["tag"]: p.value for p in points["torpor.tag.bytes"] if p.attributes["residency"] == "resident"
    }
    assert resident == TAGS
    current = [p.attributes["state"] for p in points["torpor.state"] if p.value == 1]
    assert current == ["awake"]
    assert sum(p.count for p in points["torpor.sleep.duration"]) == 1
    assert sum(p.count for p in points["torpor.wake.duration"]) == 1
    assert sum(p.value for p in points["torpor.refusals"]) == 1
    assert sum(p.value for p in points["torpor.transitions"]) == 4


def test_without_an_sdk_it_is_a_no_op() -> None:
    """With the API's default providers, attaching OpenTelemetry records nothing and breaks nothing."""
    controller = SleepController(FakeMemory(TAGS))
    handle = attach(controller, prometheus=False)
    controller.sleep(1)
    controller.wake()
    assert handle.otel is not None
    assert handle.otel.span is None
    handle.detach()


# -- the OpenTelemetry path into Prometheus -------------------------------------------------

#: The Collector's unit mapping (pkg/translator/prometheus, normalize_name.go), the part torpor uses.
COLLECTOR_UNITS = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": ""}


def collector_name(name: str, unit: str, kind: str) -> str:
    """The Prometheus name the Collector's prometheus exporter gives an OTel metric (suffixes on, the default).

    Tokens split on non-alphanumerics; ``{...}`` annotations dropped from the unit; the unit's
    suffix appended unless a token already is it; counters end in ``total``, gauges of unit ``1``
    in ``ratio``.
    """
    tokens = [t for t in re.split(r"[^a-zA-Z0-9]+", name) if t]
    bare = re.sub(r"\{[^}]*\}", "", unit)
    main, _, per = bare.partition("/")
    suffix = COLLECTOR_UNITS.get(main, main)
    if suffix and suffix not in tokens:
        tokens.append(suffix)
    if per:
        tokens += ["per", {"s": "second", "m": "minute", "h": "hour"}.get(per, per)]
    if kind == "counter":
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if kind == "gauge" and unit == "1":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    return "_".join(tokens)


def collector_label(key: str) -> str:
    """The Prometheus label the Collector makes of an attribute key (non-alphanumerics become ``_``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def test_collector_naming_rules_reproduce_the_reported_names() -> None:
    """The rules above give what the issue saw through the Collector: unit "1" gauges become torpor_state_ratio."""
    assert collector_name("torpor.state", "1", "gauge") == "torpor_state_ratio"
    assert collector_name("torpor.transitions", "1", "counter") == "torpor_transitions_total"
    assert collector_label("torpor.engine") == "torpor_engine"


def _run_both_paths(make_rig: RigMaker, otel: Any) -> tuple[CollectorRegistry, Any]:
    """One controller feeding torpor's Prometheus collector and the OTel SDK at once, through sleeps, wakes, a failure."""
    tracer_provider, _, meter_provider, _ = otel
    registry = CollectorRegistry()
    memory = FakeMemory(TAGS)
    controller = SleepController(memory, engine="both", rank=3)
    attach(controller, registry=registry, tracer_provider=tracer_provider, meter_provider=meter_provider)
    controller.sleep(1)
    with pytest.raises(InvalidTransition):
        controller.sleep(1)
    controller.wake(["weights"])
    controller.wake(["kv_cache"])
    controller.sleep(2)
    memory.fail_once("restore", "runtime")
    with pytest.raises(MemoryOperationFailed):
        controller.wake()
    controller.wake()
    # A second rank on the simulated device with a host budget: what stays on the device while asleep.
    alloc = make_rig(overhead=3 << 20, slab_bytes=0).allocator
    alloc.allocate(2 << 20, "weights")
    budgeted = SleepController(alloc, policy=Policy(host=HostMemoryPolicy(budget_bytes=8 << 20)), engine="both", rank=4)
    attach(budgeted, registry=registry, tracer_provider=tracer_provider, meter_provider=meter_provider)
    budgeted.sleep(1)
    return registry, controller


def _finite_families(registry: CollectorRegistry) -> set[str]:
    """torpor's families with at least one finite sample (OpenTelemetry has no infinite values)."""
    return {
        family.name if family.type != "counter" else f"{family.name}_total"
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if any(math.isfinite(s.value) for s in family.samples)
    }


def test_instruments_translate_to_torpor_s_prometheus_names_and_labels(otel: Any, make_rig: RigMaker) -> None:
    """Every OTel metric torpor records, named by the Collector's rules, is a torpor Prometheus family with its labels."""
    registry, _ = _run_both_paths(make_rig, otel)
    reader = otel[3]
    data = reader.get_metrics_data()
    seen: set[str] = set()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                kind = {"Sum": "counter", "Gauge": "gauge", "Histogram": "histogram"}[type(m.data).__name__]
                name = collector_name(m.name, m.unit or "", kind)
                assert name in METRICS, (m.name, m.unit, name)
                assert {"info": "gauge"}.get(METRICS[name][0], METRICS[name][0]) == kind, (name, kind)
                labels = set(BASE_LABELS) | set(METRICS[name][1])
                for point in m.data.data_points:
                    assert {collector_label(k) for k in point.attributes} == labels, (m.name, point.attributes)
                if kind == "histogram":
                    assert all(list(p.explicit_bounds) == list(DURATION_BUCKETS) for p in m.data.data_points)
                seen.add(name)
    assert seen == _finite_families(registry) & set(METRICS), _finite_families(registry) ^ seen
    assert {"torpor_asleep_device_bytes", "torpor_host_budget_bytes", "torpor_failures_total"} <= seen


def test_every_family_has_an_instrument_that_translates_back() -> None:
    """Every Prometheus family (a new one too, through the derived name) has an OTel name and unit that translate back."""
    kinds = {"info": "gauge"}
    for family, (kind, _, _) in {**METRICS, "torpor_host_budget_bytes": ("gauge", (), "")}.items():
        name, unit = otel_instrument(family)
        assert collector_name(name, unit, kinds.get(kind, kind)) == family, (family, name, unit)
    assert set(OTEL_INSTRUMENTS) <= set(METRICS)
    assert otel_instrument("torpor_host_budget_bytes") == ("torpor.host.budget.bytes", "By")


def _samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if not s.name.startswith("torpor_"):
                continue  # target_info
            labels = frozenset((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_"))
            out[(s.name, labels)] = s.value
    return out


def test_sdk_prometheus_exporter_gives_the_same_series_as_torpor_s_own(otel: Any, make_rig: RigMaker) -> None:
    """Through the SDK's PrometheusMetricReader, the same run gives the same torpor_* samples, labels and values."""
    prometheus_exporter = pytest.importorskip("opentelemetry.exporter.prometheus")
    otel_registry = CollectorRegistry()
    reader = prometheus_exporter.PrometheusMetricReader(registry=otel_registry)
    tracer_provider = otel[0]
    meter_provider = MeterProvider(metric_readers=[reader])
    try:
        registry, _ = _run_both_paths(make_rig, (tracer_provider, None, meter_provider, None))
        ours = _samples(generate_latest(registry))
        theirs = _samples(generate_latest(otel_registry))
    finally:
        meter_provider.shutdown()
    # OpenTelemetry drops non-finite measurements: a rank without a host budget (+Inf here) has no
    # torpor_host_budget_bytes series there, which the rules and the dashboard read the same way.
    ours = {k: v for k, v in ours.items() if math.isfinite(v)}
    assert set(theirs) == set(ours), {"only torpor": set(ours) - set(theirs), "only otel": set(theirs) - set(ours)}
    for key, value in ours.items():
        assert theirs[key] == pytest.approx(value, rel=1e-9, abs=1e-9), key
    assert any(name == "torpor_failures_total" for name, _ in ours)
    assert any(name == "torpor_last_wake_duration_seconds" for name, _ in ours)


def test_a_keepers_fallbacks_are_an_otel_counter(otel: Any, tmp_path: Any, make_rig: RigMaker) -> None:
    """A keeper absent at attach: OpenTelemetry shows it down and counts the host ranges kept in-process, as Prometheus does."""
    from torpor.allocator.host.offload import HostPolicy
    from torpor.keeper import attach as keep

    tracer_provider, _, meter_provider, reader = otel
    alloc = make_rig("cuda_like", capacity=64 << 20, host=HostPolicy(chunk_bytes=2 << 20)).allocator
    controller = SleepController(alloc, engine="ok")
    attach(controller, tracer_provider=tracer_provider, meter_provider=meter_provider, prometheus=False)
    backing = keep(alloc, controller, keeper=tmp_path / "nobody" / "keeper.sock", engine="ok-keep")
    address = alloc.allocate(3 << 20, tag="weights")
    alloc.write(address, b"\x01" * (3 << 20))
    controller.sleep(1)
    points = metric_points(reader)
    assert backing.gone is not None and backing.fallbacks >= 1
    assert [p.value for p in points["torpor.keeper.up"]] == [0]
    fallbacks = points["torpor.keeper.fallbacks"]
    assert [p.value for p in fallbacks] == [backing.fallbacks]
    assert fallbacks[0].attributes["keeper_engine"] == "ok-keep"
