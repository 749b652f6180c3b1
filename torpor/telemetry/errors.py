"""Errors of torpor.telemetry, built with the data they name."""

from __future__ import annotations

from torpor.errors import DuplicateRank, TelemetryError, TorporError  # noqa: F401 (re-exported: the old import path)

__all__ = ["DuplicateRank", "TelemetryError"]
