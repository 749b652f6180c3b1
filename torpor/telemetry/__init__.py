"""torpor.telemetry: Prometheus, OpenTelemetry, an HTTP endpoint and a Grafana dashboard, all fed by controller events.

Telemetry is a subscriber: it reads the controller's projection and events and
never calls into the allocator or changes the controller. Nothing in torpor
needs it; :func:`attach` turns it on for one controller and
:meth:`Telemetry.detach` turns it off again.
"""

from __future__ import annotations

from torpor.errors import DuplicateRank, TelemetryError
from torpor.statemachine.log.logsource import LogSource
from torpor.telemetry.grafana import dashboard, render_dashboard
from torpor.telemetry.multiprocess import MultiprocessSink, mark_process_dead, multiprocess_registry
from torpor.telemetry.otel import OtelSink
from torpor.telemetry.prometheus import TorporCollector, exposition
from torpor.telemetry.samples import METRICS
from torpor.telemetry.server import Server, serve
from torpor.telemetry.session import Telemetry, attach
from torpor.telemetry.tracker import Observation, Source, Tracker, interpret

__all__ = [
    "METRICS",
    "DuplicateRank",
    "LogSource",
    "MultiprocessSink",
    "Observation",
    "OtelSink",
    "Server",
    "Source",
    "Telemetry",
    "TelemetryError",
    "TorporCollector",
    "Tracker",
    "attach",
    "dashboard",
    "exposition",
    "interpret",
    "mark_process_dead",
    "multiprocess_registry",
    "render_dashboard",
    "serve",
]
