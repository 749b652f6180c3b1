"""OpenTelemetry through ``opentelemetry-api`` only: a span per sleep and wake, a child span per tag, metrics.

Spans are built from events after the fact, with the events' own times: a
``torpor.sleep`` or ``torpor.wake`` span from the request to its completion,
one child span per tag (bytes, offload or discard, seconds), span events for
rollbacks and refusals, and an error status when a sleep aborts or a wake
fails. A refusal outside any transition gets a short span of its own named
after the refused command. Metrics go through the meter: observable gauges for
bytes and state, histograms for durations, counters for refusals and
transitions. With no SDK configured the API's no-op providers make
all of this free; providers can be injected (tests pass the SDK's in-memory ones).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, Status, StatusCode

from torpor.statemachine.events import Event, EventKind
from torpor.statemachine.states import State
from torpor.telemetry.tracker import Observation, Tracker, woken_label

SCOPE = "torpor"


def _ns(wall: float) -> int:
    return int(wall * 1e9)


def _live(injected: object, get_global: Callable[[], object], noop: type) -> bool:
    """True when a provider would record: injected, or a global one set (not the API's proxy or no-op)."""
    provider = injected if injected is not None else get_global()
    return not isinstance(provider, noop) and type(provider).__name__ not in _PROXIES


_PROXIES = frozenset({"ProxyTracerProvider", "_ProxyMeterProvider", "ProxyMeterProvider"})

#: Events that begin something: the sink re-reads the global providers there (an SDK may have been set since).
_STARTS = frozenset({EventKind.OPENED, EventKind.SLEEP_REQUESTED, EventKind.WAKE_REQUESTED, EventKind.REFUSED})


class _Instruments:
    """The meter's instruments for one meter provider, shared by every tracker attached to it."""

    def __init__(self, meter_provider: metrics.MeterProvider | None, version: str) -> None:
        meter = metrics.get_meter(SCOPE, version, meter_provider=meter_provider)
        self.trackers: list[Tracker] = []
        self.lock = threading.Lock()
        meter.create_observable_gauge(
            "torpor.tag.bytes", [self._tag_bytes], unit="By", description="Bytes of each memory tag by residency"
        )
        meter.create_observable_gauge(
            "torpor.pinned_host.bytes", [self._pinned], unit="By", description="Pinned host memory held for backups"
        )
        meter.create_observable_gauge(
            "torpor.state", [self._state], unit="1", description="1 for the state each rank is in, 0 for the others"
        )
        self.sleep_duration = meter.create_histogram(
            "torpor.sleep.duration", unit="s", description="Duration of completed sleeps, by level"
        )
        self.wake_duration = meter.create_histogram(
            "torpor.wake.duration", unit="s", description="Duration of completed wakes, by woken tags"
        )
        self.transitions = meter.create_counter("torpor.transitions", unit="1", description="State transitions")
        self.refusals = meter.create_counter("torpor.refusals", unit="1", description="Commands refused by the guard")

    def _each(self) -> Iterator[tuple[dict[str, Any], Tracker]]:
        with self.lock:
            trackers = list(self.trackers)
        for tracker in trackers:
            yield {"torpor.engine": tracker.engine, "torpor.rank": tracker.rank}, tracker

    def _tag_bytes(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        out: list[metrics.Observation] = []
        for base, tracker in self._each():
            for tag, usage in sorted(dict(tracker.source.projection.residency).items()):
                for residency, value in (
                    ("resident", usage.resident),
                    ("host", usage.host),
                    ("discarded", usage.discarded),
                ):
                    attrs = {**base, "torpor.tag": tag, "torpor.residency": residency}
                    out.append(metrics.Observation(value, attrs))
        return out

    def _pinned(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        return [metrics.Observation(t.source.projection.pinned_bytes, base) for base, t in self._each()]

    def _state(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        out: list[metrics.Observation] = []
        for base, tracker in self._each():
            current = tracker.source.projection.state
            out.extend(metrics.Observation(1 if s is current else 0, {**base, "torpor.state": s.value}) for s in State)
        return out


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
        data, when = event.data, _ns(event.wall)
        if kind is EventKind.SLEEP_REQUESTED:
            self._open("torpor.sleep", when, {"torpor.level": int(data["level"])})
            self._backed_up = {}
        elif kind is EventKind.WAKE_REQUESTED:
            self._open("torpor.wake", when, {"torpor.tags": woken_label(data.get("tags"))})
        elif kind is EventKind.TAG_BACKED_UP:
            self._backed_up[str(data["tag"])] = event
        elif kind is EventKind.TAG_RELEASED:
            self._tag_span("torpor.sleep.tag", event, self._backed_up.pop(str(data["tag"]), None))
        elif kind is EventKind.TAG_RESTORED:
            if data.get("source") == "rollback":
                self._event(
                    "torpor.rolled_back", when, {"torpor.tag": str(data["tag"]), "torpor.bytes": int(data["bytes"])}
                )
            else:
                self._tag_span("torpor.wake.tag", event, None)
        elif kind is EventKind.TAG_ROLLED_BACK:
            self._event(
                "torpor.rolled_back", when, {"torpor.tag": str(data["tag"]), "torpor.bytes": int(data["bytes"])}
            )
        elif kind in (EventKind.SLEEP_COMPLETED, EventKind.WAKE_COMPLETED):
            keys = ("seconds", "freed", "offloaded", "discarded", "restored", "pinned")
            self._close(when, {f"torpor.{k}": data[k] for k in keys if k in data and data[k] is not None})
        elif kind in (EventKind.SLEEP_ABORTED, EventKind.WAKE_FAILED):
            self._close(when, {"torpor.error": str(data.get("error", ""))}, str(data.get("reason", "")))
        elif kind is EventKind.REFUSED:
            self._refused(event)

    def _record(self, observations: list[Observation]) -> None:
        inst = self.instruments
        for obs in observations:
            if obs.metric == "sleep_seconds":
                inst.sleep_duration.record(obs.value, {**self.base, "torpor.level": obs.labels[0]})
            elif obs.metric == "wake_seconds":
                inst.wake_duration.record(obs.value, {**self.base, "torpor.tags": obs.labels[0]})
            elif obs.metric == "transition":
                attrs = {**self.base, "torpor.from_state": obs.labels[0], "torpor.to_state": obs.labels[1]}
                inst.transitions.add(1, attrs)
            elif obs.metric == "refusal":
                inst.refusals.add(1, {**self.base, "torpor.command": obs.labels[0], "torpor.reason": obs.labels[1]})

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
        end = _ns(event.wall)
        seconds = float(data.get("seconds", 0.0))
        start = end - int(seconds * 1e9)
        attrs: dict[str, Any] = {  # engine and rank are on the parent span
            "torpor.tag": str(data["tag"]),
            "torpor.bytes": int(data["bytes"]),
            "torpor.seconds": seconds,
        }
        if "action" in data:
            attrs["torpor.action"] = str(data["action"])
        if "source" in data:
            attrs["torpor.source"] = str(data["source"])
        if backup is not None:
            backup_seconds = float(backup.data.get("seconds", 0.0))
            attrs["torpor.backup_seconds"] = backup_seconds
            attrs["torpor.seconds"] = seconds + backup_seconds
            start = min(start, _ns(backup.wall) - int(backup_seconds * 1e9))
        context = trace.set_span_in_context(self.span) if self.span is not None else None
        child = self.tracer.start_span(name, context=context, start_time=start, attributes=attrs)
        child.end(end_time=end)

    def _refused(self, event: Event) -> None:
        data, when = event.data, _ns(event.wall)
        attrs = {
            "torpor.command": str(data.get("command", "")),
            "torpor.reason": str(data.get("error", "")),
            "torpor.message": str(data.get("reason", "")),
            "torpor.state": str(data.get("state", "")),
        }
        if data.get("holders"):
            attrs["torpor.holders"] = [str(h) for h in data["holders"]]  # type: ignore[assignment]
        if self.span is not None:
            self.span.add_event("torpor.refused", attributes=attrs, timestamp=when)
            return
        span = self.tracer.start_span(f"torpor.{attrs['torpor.command']}", start_time=when, attributes=self.base)
        span.add_event("torpor.refused", attributes=attrs, timestamp=when)
        span.set_status(Status(StatusCode.ERROR, attrs["torpor.message"]))
        span.end(end_time=when)
