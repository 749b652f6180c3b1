"""The read model over several ranks' event logs in one directory: one engine-wide state per engine.

:mod:`.fleetview` holds the views (a rank, a group outcome, an engine) and how ranks merge;
:mod:`.ranklogs` finds and reads the rank logs (``fleet``, ``wait_fleet``, ``rank_logs``). It reads
the logs through the event store and the projection, never the controller, the allocator, hooks,
telemetry or torch; :mod:`torpor.hooks` and ``torpor.fleet`` export the same names.
"""

from __future__ import annotations

from torpor.readmodel.ranklogs import (
    ENGINE_STATES,
    EngineView,
    FleetError,
    FleetView,
    GroupView,
    RankView,
    fleet,
    rank_logs,
    wait_fleet,
    wait_fleet_async,
)

__all__ = [
    "ENGINE_STATES",
    "EngineView",
    "FleetError",
    "FleetView",
    "GroupView",
    "RankView",
    "fleet",
    "rank_logs",
    "wait_fleet",
    "wait_fleet_async",
]
