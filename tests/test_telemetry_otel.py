"""Tests for torpor.telemetry.otel: spans per sleep, wake and tag, refusal events, metrics, through the SDK in memory."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from torpor import SleepController
from torpor.errors import InvalidTransition, MemoryOperationFailed
from torpor.telemetry import attach
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
    assert event.attributes["torpor.reason"] == "InvalidTransition"
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
    assert wake.attributes["torpor.error"] == "MemoryOperationFailed"
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
        p.attributes["torpor.tag"]: p.value
        for p in points["torpor.tag.bytes"]
        if p.attributes["torpor.residency"] == "resident"
    }
    assert resident == TAGS
    current = [p.attributes["torpor.state"] for p in points["torpor.state"] if p.value == 1]
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
