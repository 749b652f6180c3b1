"""Turning telemetry on for one controller (:func:`attach`) and off again (:meth:`Telemetry.detach`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from opentelemetry import metrics, trace
from prometheus_client.registry import REGISTRY, CollectorRegistry

from torpor._version import __version__
from torpor.telemetry import multiprocess as _multiprocess
from torpor.telemetry.multiprocess import MultiprocessSink
from torpor.telemetry.otel import OtelSink
from torpor.telemetry.prometheus import TorporCollector, collector_for, release_collector
from torpor.telemetry.tracker import Source, Tracker


def _version() -> str:
    return __version__


@dataclass
class Telemetry:
    """What :func:`attach` turned on for one controller; :meth:`detach` turns it off."""

    tracker: Tracker
    registry: CollectorRegistry | None = None
    collector: TorporCollector | None = None
    multiprocess: MultiprocessSink | None = None
    otel: OtelSink | None = None
    _detached: bool = field(default=False, repr=False)

    def detach(self) -> None:
        """Unsubscribe and stop exposing this controller (idempotent)."""
        if self._detached:
            return
        self._detached = True
        self.tracker.close()
        if self.collector is not None and self.registry is not None:
            self.collector.remove(self.tracker)
            release_collector(self.registry)
        if self.multiprocess is not None:
            self.multiprocess.close()
        if self.otel is not None:
            self.otel.close()


def attach(
    controller: Source,
    registry: CollectorRegistry = REGISTRY,
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
    *,
    prometheus: bool = True,
    otel: bool = True,
    multiprocess: bool | None = None,
) -> Telemetry:
    """Turn telemetry on for ``controller``.

    Prometheus: a scrape-time collector in ``registry`` (one per registry,
    shared by every controller attached to it), or, in multiprocess mode
    (``multiprocess=None`` follows ``PROMETHEUS_MULTIPROC_DIR``), metric files
    the serving process merges. OpenTelemetry: spans and metrics through the
    given providers, or the global ones (no-ops unless an SDK is configured).
    """
    version = _version()
    tracker = Tracker(controller)
    handle = Telemetry(tracker)
    try:
        if prometheus:
            if _multiprocess.enabled() if multiprocess is None else multiprocess:
                handle.multiprocess = MultiprocessSink(version, tracker.engine, tracker.rank)
                tracker.add_sink(handle.multiprocess)
            else:
                handle.registry = registry
                handle.collector = collector_for(registry, version)
                handle.collector.add(tracker)
        if otel:
            handle.otel = OtelSink(tracker, version, tracer_provider, meter_provider)
            tracker.add_sink(handle.otel)
    except BaseException:
        handle.detach()
        raise
    return handle
