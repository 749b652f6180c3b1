"""The ``vllm.endpoint_plugins`` entry: ``/torpor/state`` and ``/torpor/events`` on vLLM's API server.

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS`` (``VLLM_PLUGINS=torpor``;
list the general plugin too when the variable is set, as it filters every group).
The API server holds no controller: the workers do, and each writes its rank's
event log into the shared log directory (``TORPOR_LOG_DIR``). Both routes read
those logs and change nothing:

- ``GET /torpor/state[?engine=E]``: the engine-wide state merged from every
  rank (what ``torpor status DIR --json`` prints);
- ``GET /torpor/events?rank=N[&engine=E][&after=SEQ][&limit=L][&wait=S]``: the
  rank's events after ``SEQ`` as JSON, oldest first; with ``wait`` it waits up
  to ``S`` seconds (at most 30) for a new one (long poll, for RL controllers).

A bad parameter gets a 400 naming it; a directory without logs a 404.
This module imports FastAPI (vLLM's server framework); only vLLM's plugin
loader imports it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from torpor.errors import TorporError
from torpor.hooks.fleet import FleetError, fleet, rank_logs
from torpor.hooks.vllm.facade import default_log_dir
from torpor.statemachine.log import read_events
from torpor.telemetry.endpoint import BadRequest, int_param, seconds_param

MAX_WAIT = 30.0
MAX_LIMIT = 10_000
POLL = 0.2


def _rank_log(directory: Path, engine: str | None, rank: int) -> Path:
    logs = rank_logs(directory)
    if not logs:
        msg = f"no per-rank event logs in {directory}"
        raise FleetError(msg)
    if engine is None:
        if len(logs) > 1:
            msg = f"several engines log into {directory} ({', '.join(sorted(logs))}); pass engine="
            raise BadRequest(msg)
        engine = next(iter(logs))
    if engine not in logs:
        msg = f"no engine {engine!r} in {directory}; engines: {', '.join(sorted(logs))}"
        raise FleetError(msg)
    if rank not in logs[engine]:
        msg = f"engine {engine!r} has no log for rank {rank}; ranks: {', '.join(map(str, sorted(logs[engine])))}"
        raise FleetError(msg)
    return logs[engine][rank]


def events_after(path: Path, after: int, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` events of the log at ``path`` with a sequence number above ``after``."""
    out: list[dict[str, Any]] = []
    for event in read_events(path):
        if event.seq > after:
            out.append(event.to_dict())
            if len(out) >= limit:
                break
    return out


class TorporEndpointPlugin:
    """vLLM ``EndpointPlugin``: read-only torpor routes on the API server."""

    name = "torpor"
    required_tasks = None

    def __init__(self, log_dir: str | Path | None = None) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None

    def directory(self, request: Request) -> Path:
        """The shared log directory: this plugin's, the app state's, else ``TORPOR_LOG_DIR``'s default."""
        if self.log_dir is not None:
            return self.log_dir
        stored = getattr(request.app.state, "torpor_log_dir", None)
        return Path(stored) if stored else default_log_dir()

    def attach_router(self, app: FastAPI) -> None:
        """Add ``GET /torpor/state`` and ``GET /torpor/events``."""
        router = APIRouter()

        def error(status: int, reason: str) -> JSONResponse:
            return JSONResponse({"error": reason}, status_code=status)

        @router.get("/torpor/state")
        async def torpor_state(request: Request) -> JSONResponse:
            """The engine-wide sleep state merged from the per-rank event logs."""
            engine = request.query_params.get("engine") or None
            try:
                view = await asyncio.to_thread(fleet, self.directory(request), engine=engine)
            except FleetError as exc:
                return error(404, str(exc))
            return JSONResponse(view.to_dict())

        @router.get("/torpor/events")
        async def torpor_events(request: Request) -> JSONResponse:
            """One rank's events after a sequence number, optionally waiting for the next one."""
            params = request.query_params
            unknown = sorted(set(params) - {"engine", "rank", "after", "limit", "wait"})
            try:
                if unknown:
                    msg = f"unknown parameter(s) {', '.join(unknown)}; known: engine, rank, after, limit, wait"
                    raise BadRequest(msg)
                rank = int_param(params, "rank", 0, 0, 1 << 20)
                after = int_param(params, "after", 0, 0, 1 << 62)
                limit = int_param(params, "limit", 1000, 1, MAX_LIMIT)
                wait = seconds_param(params, "wait", 0.0, MAX_WAIT)
            except BadRequest as exc:
                return error(400, str(exc))
            directory = self.directory(request)
            try:
                path = _rank_log(directory, params.get("engine") or None, rank)
            except BadRequest as exc:
                return error(400, str(exc))
            except FleetError as exc:
                return error(404, str(exc))
            deadline = time.monotonic() + wait
            while True:
                try:
                    events = await asyncio.to_thread(events_after, path, after, limit)
                except (TorporError, OSError, ValueError) as exc:
                    return error(500, f"cannot read {path}: {exc}")
                if events or time.monotonic() >= deadline:
                    return JSONResponse({"path": str(path), "rank": rank, "after": after, "events": events})
                await asyncio.sleep(POLL)

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Remember the log directory the routes read (``TORPOR_LOG_DIR`` as the server started)."""
        state.torpor_log_dir = str(self.log_dir or default_log_dir())


def endpoint_plugin() -> TorporEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry point: a zero-argument factory."""
    return TorporEndpointPlugin()
