"""The errors of what reads state out: the metrics endpoint and its client, telemetry, the read model over several ranks' logs."""

from __future__ import annotations

from torpor.errors.base import TorporError

__all__ = [
    "BadRequest",
    "ConnectionShed",
    "DuplicateRank",
    "EndpointError",
    "FleetError",
    "NotInFleet",
    "ResponseStalled",
    "StateTimeout",
    "TelemetryError",
]


class EndpointError(TorporError, RuntimeError):
    """An endpoint refused a request or could not be reached: ``url``, ``status`` (None: no answer), ``reason``."""

    def __init__(self, url: str, status: int | None, reason: str) -> None:
        self.url = url
        self.status = status
        self.reason = reason
        answer = f"answered {status}" if status is not None else "did not answer"
        super().__init__(f"{url} {answer}: {reason}")


class StateTimeout(TorporError, TimeoutError):
    """``Client.wait_for`` ran out of time: names the state wanted and the state seen last."""

    def __init__(self, wanted: str, seen: str, timeout: float, url: str) -> None:
        self.wanted = wanted
        self.seen = seen
        self.timeout = timeout
        self.url = url
        super().__init__(f"{url}: the rank did not reach {wanted!r} within {timeout:g} s; it is {seen!r}")


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


class BadRequest(TorporError, ValueError):
    """A query the endpoint refuses; the message is the 400 body's reason."""


class FleetError(TorporError, ValueError):
    """A directory that holds no per-rank event logs (or is not a directory)."""


class NotInFleet(TorporError, KeyError):
    """An engine or a rank that the logs of a directory do not hold."""


class ResponseStalled(TelemetryError, TimeoutError):
    """A response the client did not read within the write timeout: the connection is dropped."""


class ConnectionShed(TelemetryError, ConnectionAbortedError):
    """A connection dropped to make room while its client was not reading."""
