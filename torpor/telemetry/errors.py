"""Errors of torpor.telemetry, built with the data they name."""

from __future__ import annotations

from torpor.errors import TorporError


class TelemetryError(TorporError):
    """Base of the errors torpor.telemetry raises."""


class DuplicateRank(TelemetryError, ValueError):
    """A second controller with the same engine and rank attached where the first is still exposed.

    Two sources with the same labels would give duplicate series, which
    Prometheus rejects. Carries ``engine``, ``rank`` and ``where`` (the registry
    or the multiprocess directory).
    """

    def __init__(self, engine: str, rank: int, where: str) -> None:
        self.engine = engine
        self.rank = rank
        self.where = where
        super().__init__(
            f"cannot attach engine {engine!r} rank {rank} to {where}: a controller with the same engine and rank "
            "is already attached there (its series would be duplicated); detach it first or use another engine name"
        )
