"""OpenTelemetry through ``opentelemetry-api`` only: a span per sleep and wake, a child span per tag, metrics.

Spans are built from events after the fact, with the events' own times: a
``torpor.sleep`` or ``torpor.wake`` span from the request to its completion,
one child span per tag (bytes, offload or discard, seconds), span events for
rollbacks and refusals, and an error status when a sleep aborts or a wake
fails. A refusal outside any transition gets a short span of its own named
after the refused command. Metrics go through the meter: one instrument per
Prometheus family (:data:`OTEL_INSTRUMENTS`), named so that OpenTelemetry's
Prometheus translation gives back Prometheus's names and labels, with bucket
advice on the duration histograms. With no SDK configured the API's no-op
providers make all of this free; providers can be injected (tests pass the SDK's in-memory ones).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, Status, StatusCode

from torpor.statemachine.core.events import (
    Event,
    EventKind,
    Refused,
    SleepAborted,
    SleepCompleted,
    SleepRequested,
    TagBackedUp,
    TagReleased,
    TagRestored,
    TagRolledBack,
    WakeCompleted,
    WakeFailed,
    WakeRequested,
)
from torpor.telemetry.rankstats import DURATION_BUCKETS, RankStats
from torpor.telemetry.samples import BASE_LABELS, COUNTERS, HISTOGRAMS, METRICS, rank_samples
from torpor.telemetry.tracker import Observation, Tracker, woken_label

SCOPE = "torpor"

#: Counter families no event counts: a total read from the rank's state (the keeper's fallbacks), observed.
OBSERVEDCOUNTERS = tuple(f for f, (kind, _, _) in METRICS.items() if kind == "counter" and f not in COUNTERS.values())


def _ns(wall: float) -> int:
    return int(wall * 1e9)


def _live(injected: object, get_global: Callable[[], object], noop: type) -> bool:
    """True when a provider would record: injected, or a global one set (not the API's proxy or no-op)."""
    provider = injected if injected is not None else get_global()
    return not isinstance(provider, noop) and type(provider).__name__ not in _PROXIES


_PROXIES = frozenset({"ProxyTracerProvider", "_ProxyMeterProvider", "ProxyMeterProvider"})

#: Events that begin something: the sink re-reads the global providers there (an SDK may have been set since).
_STARTS = frozenset({EventKind.OPENED, EventKind.SLEEP_REQUESTED, EventKind.WAKE_REQUESTED, EventKind.REFUSED})


#: The OpenTelemetry instrument behind each Prometheus family: (name, unit). OpenTelemetry's
#: Prometheus translation (the Collector's ``prometheus`` exporter and the SDK's
#: ``PrometheusMetricReader``: unit suffix unless the name has it, ``_total`` on counters,
#: ``{...}`` annotations dropped) turns each back into the family's name, so the shipped
#: dashboard and rules read either path (tests/test_telemetry_otel.py checks both rule sets).
OTEL_INSTRUMENTS: dict[str, tuple[str, str]] = {
    "torpor_info": ("torpor.info", ""),
    "torpor_state": ("torpor.state", "{state}"),
    "torpor_state_since_timestamp_seconds": ("torpor.state_since.timestamp", "s"),
    "torpor_tag_bytes": ("torpor.tag.bytes", "By"),
    "torpor_pinned_host_bytes": ("torpor.pinned_host.bytes", "By"),
    "torpor_last_sleep_duration_seconds": ("torpor.last_sleep.duration", "s"),
    "torpor_last_wake_duration_seconds": ("torpor.last_wake.duration", "s"),
    "torpor_cudagraphs": ("torpor.cudagraphs", "{graph}"),
    "torpor_transitions_total": ("torpor.transitions", "{transition}"),
    "torpor_sleep_duration_seconds": ("torpor.sleep.duration", "s"),
    "torpor_wake_duration_seconds": ("torpor.wake.duration", "s"),
    "torpor_tag_transfer_bytes_total": ("torpor.tag.transfer.bytes", "By"),
    "torpor_tag_transfer_seconds_total": ("torpor.tag.transfer.seconds", "s"),
    "torpor_wake_checked_bytes_total": ("torpor.wake.checked.bytes", "By"),
    "torpor_refusals_total": ("torpor.refusals", "{refusal}"),
    "torpor_failures_total": ("torpor.failures", "{failure}"),
    "torpor_events_total": ("torpor.events", "{event}"),
}

#: Metric attribute per Prometheus label where they differ; the translation maps each back
#: (``.`` becomes ``_``). Labels not listed are their own attribute name.
OTEL_ATTRIBUTES: dict[str, str] = {
    "torpor_engine": "torpor.engine",
    "torpor_rank": "torpor.rank",
    "error_type": "error.type",
}


def attribute(label: str) -> str:
    """The OpenTelemetry metric attribute for a Prometheus label of torpor's."""
    return OTEL_ATTRIBUTES.get(label, label)


def _attributes(family: str, values: tuple[str, ...]) -> dict[str, Any]:
    return {attribute(label): value for label, value in zip(METRICS[family][1], values, strict=True)}


def otel_instrument(family: str) -> tuple[str, str]:
    """(name, unit) of the OpenTelemetry instrument for a Prometheus family of torpor's.

    From :data:`OTEL_INSTRUMENTS`, else derived so that the translation gives the family back:
    ``torpor_x_y_bytes`` -> ``torpor.x.y.bytes`` in ``By``, ``..._seconds`` in ``s``, ``_total`` dropped.
    """
    known = OTEL_INSTRUMENTS.get(family)
    if known is not None:
        return known
    base = family.removesuffix("_total")
    unit = "By" if base.endswith("_bytes") else "s" if base.endswith("_seconds") else ""
    return base.replace("_", "."), unit


def _attribute_value(label: str, value: str) -> Any:
    return int(value) if label == BASE_LABELS[1] else value


class _Instruments:
    """The meter's instruments for one meter provider, shared by every tracker attached to it.

    Gauges read the same samples Prometheus does (:func:`rank_samples` of the live projection),
    so every gauge family has its instrument, and so do the counters no event counts
    (:data:`OBSERVEDCOUNTERS`); the other counters and the histograms record the tracker's
    observations as they come.
    """

    def __init__(self, meter_provider: metrics.MeterProvider | None, version: str) -> None:
        meter = metrics.get_meter(SCOPE, version, meter_provider=meter_provider)
        self.version = version
        self.trackers: list[Tracker] = []
        self.lock = threading.Lock()
        for family, (kind, _, doc) in METRICS.items():
            if kind in ("gauge", "info"):
                name, unit = otel_instrument(family)
                meter.create_observable_gauge(name, [self._gauge(family)], unit=unit, description=doc)
        self.histograms: dict[str, metrics.Histogram] = {}
        for metric, family in HISTOGRAMS.items():
            name, unit = otel_instrument(family)
            self.histograms[metric] = meter.create_histogram(
                name,
                unit=unit,
                description=METRICS[family][2],
                explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS),
            )
        self.counters: dict[str, metrics.Counter] = {}
        for metric, family in COUNTERS.items():
            name, unit = otel_instrument(family)
            self.counters[metric] = meter.create_counter(name, unit=unit, description=METRICS[family][2])
        for family in OBSERVEDCOUNTERS:  # read from the rank's state at each collection, as the gauges are
            name, unit = otel_instrument(family)
            meter.create_observable_counter(name, [self._gauge(family)], unit=unit, description=METRICS[family][2])

    def _gauge(self, family: str) -> Callable[[metrics.CallbackOptions], Iterable[metrics.Observation]]:
        def observe(_options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
            with self.lock:
                trackers = list(self.trackers)
            out: list[metrics.Observation] = []
            for tracker in trackers:
                for sample in rank_samples(tracker, RankStats(), self.version):
                    if sample.family == family and math.isfinite(sample.value):  # OTel has no +Inf (no host budget)
                        attrs = {attribute(k): _attribute_value(k, v) for k, v in sample.labels}
                        out.append(metrics.Observation(sample.value, attrs))
            return out

        return observe


_instruments: dict[int, tuple[object, _Instruments]] = {}
_instruments_lock = threading.Lock()


def _instruments_for(meter_provider: metrics.MeterProvider | None, version: str) -> _Instruments:
    with _instruments_lock:
        key = id(meter_provider)
        entry = _instruments.get(key)
        if entry is None or entry[0] is not meter_provider:
            entry = (meter_provider, _Instruments(meter_provider, version))
            _instruments[key] = entry
        return entry[1]


class OtelSink:
    """Tracker sink that turns one rank's events into spans and metric recordings."""

    def __init__(
        self,
        tracker: Tracker,
        version: str,
        tracer_provider: trace.TracerProvider | None = None,
        meter_provider: metrics.MeterProvider | None = None,
    ) -> None:
        self.tracer = trace.get_tracer(SCOPE, version, tracer_provider=tracer_provider)
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._metrics_on = _live(meter_provider, metrics.get_meter_provider, metrics.NoOpMeterProvider)
        self._spans_on = _live(tracer_provider, trace.get_tracer_provider, trace.NoOpTracerProvider)
        self.instruments = _instruments_for(meter_provider, version)
        self.base: dict[str, Any] = {"torpor.engine": tracker.engine, "torpor.rank": tracker.rank}
        self.metric_base: dict[str, Any] = {
            attribute(BASE_LABELS[0]): tracker.engine,
            attribute(BASE_LABELS[1]): tracker.rank,
        }
        self.span: Span | None = None
        self._backed_up: dict[str, Event] = {}
        with self.instruments.lock:
            self.instruments.trackers.append(tracker)
        self._tracker = tracker

    def close(self) -> None:
        """Stop reporting this tracker's gauges; end an open span."""
        with self.instruments.lock:
            if self._tracker in self.instruments.trackers:
                self.instruments.trackers.remove(self._tracker)
        if self.span is not None:
            self.span.end()
            self.span = None

    def handle(self, tracker: Tracker, event: Event, observations: list[Observation]) -> None:
        """Tracker sink: open, annotate and close spans; record metrics (skipped while the providers are no-ops)."""
        kind = event.kind
        if kind in _STARTS:  # look at the providers once per command, not once per event
            self._metrics_on = _live(self._meter_provider, metrics.get_meter_provider, metrics.NoOpMeterProvider)
            self._spans_on = _live(self._tracer_provider, trace.get_tracer_provider, trace.NoOpTracerProvider)
        if self._metrics_on and observations:
            self._record(observations)
        if not self._spans_on and self.span is None:
            return
        when = _ns(event.wall)
        match event.data:
            case SleepRequested(level=level):
                self._open("torpor.sleep", when, {"torpor.level": level})
                self._backed_up = {}
            case WakeRequested(tags=tags):
                self._open("torpor.wake", when, {"torpor.tags": woken_label(tags)})
            case TagBackedUp(tag=tag):
                self._backed_up[tag] = event
            case TagReleased(tag=tag):
                self._tag_span("torpor.sleep.tag", event, self._backed_up.pop(tag, None))
            case TagRestored(source="rollback", tag=tag, bytes=nbytes) | TagRolledBack(tag=tag, bytes=nbytes):
                self._event("torpor.rolled_back", when, {"torpor.tag": tag, "torpor.bytes": nbytes})
            case TagRestored():
                self._tag_span("torpor.wake.tag", event, None)
            case SleepCompleted() as d:
                figures = {"seconds": d.seconds, "freed": d.freed, "offloaded": d.offloaded, "discarded": d.discarded}
                self._close(when, _completed(figures, d.pinned))
            case WakeCompleted() as d:
                self._close(when, _completed({"seconds": d.seconds, "restored": d.restored}, d.pinned))
            case SleepAborted(error=error, reason=reason) | WakeFailed(error=error, reason=reason):
                self._close(when, {"error.type": error or "TorporError"}, reason or "")
            case Refused() as d:
                self._refused(event, d)

    def _record(self, observations: list[Observation]) -> None:
        inst = self.instruments
        for obs in observations:
            histogram = inst.histograms.get(obs.metric)
            if histogram is not None:
                histogram.record(obs.value, {**self.metric_base, **_attributes(HISTOGRAMS[obs.metric], obs.labels)})
                continue
            counter = inst.counters.get(obs.metric)
            if counter is not None:
                counter.add(obs.value, {**self.metric_base, **_attributes(COUNTERS[obs.metric], obs.labels)})

    def _open(self, name: str, when: int, attrs: dict[str, Any]) -> None:
        if self.span is not None:  # a transition the events never closed (a crash): end it as unknown
            self.span.set_status(Status(StatusCode.ERROR, "no completion event"))
            self.span.end(end_time=when)
        self.span = self.tracer.start_span(name, start_time=when, attributes={**self.base, **attrs})

    def _close(self, when: int, attrs: dict[str, Any], error: str = "") -> None:
        if self.span is None:
            return
        self.span.set_attributes(attrs)
        if error:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end(end_time=when)
        self.span = None

    def _event(self, name: str, when: int, attrs: dict[str, Any]) -> None:
        if self.span is not None:
            self.span.add_event(name, attributes=attrs, timestamp=when)

    def _tag_span(self, name: str, event: Event, backup: Event | None) -> None:
        data = event.data
        if not isinstance(data, TagReleased | TagRestored):
            return
        end = _ns(event.wall)
        seconds = float(data.seconds)
        start = end - int(seconds * 1e9)
        attrs: dict[str, Any] = {  # engine and rank are on the parent span
            "torpor.tag": data.tag,
            "torpor.bytes": data.bytes,
            "torpor.seconds": seconds,
        }
        if isinstance(data, TagReleased) and "action" in data:
            attrs["torpor.action"] = data.action
        if isinstance(data, TagRestored) and "source" in data:
            attrs["torpor.source"] = data.source
        if isinstance(data, TagRestored) and data.checked:
            attrs["torpor.checked_bytes"] = data.checked
        if backup is not None:
            backup_seconds = float(backup.data.seconds) if isinstance(backup.data, TagBackedUp) else 0.0
            attrs["torpor.backup_seconds"] = backup_seconds
            attrs["torpor.seconds"] = seconds + backup_seconds
            start = min(start, _ns(backup.wall) - int(backup_seconds * 1e9))
        context = trace.set_span_in_context(self.span) if self.span is not None else None
        child = self.tracer.start_span(name, context=context, start_time=start, attributes=attrs)
        child.end(end_time=end)

    def _refused(self, event: Event, data: Refused) -> None:
        when = _ns(event.wall)
        attrs = {
            "torpor.command": data.command,
            "error.type": data.error or "TorporError",
            "torpor.message": data.reason or "",
            "torpor.state": data.state,
        }
        if data.holders:
            attrs["torpor.holders"] = list(data.holders)  # type: ignore[assignment]
        if self.span is not None:
            self.span.add_event("torpor.refused", attributes=attrs, timestamp=when)
            return
        span = self.tracer.start_span(f"torpor.{attrs['torpor.command']}", start_time=when, attributes=self.base)
        span.add_event("torpor.refused", attributes=attrs, timestamp=when)
        span.set_status(Status(StatusCode.ERROR, attrs["torpor.message"]))
        span.end(end_time=when)


def _completed(figures: dict[str, float], pinned: int | None) -> dict[str, Any]:
    """A completed transition's span attributes: its figures, and the pinned host bytes when said."""
    attrs: dict[str, Any] = {f"torpor.{name}": value for name, value in figures.items()}
    if pinned is not None:
        attrs["torpor.pinned"] = pinned
    return attrs
