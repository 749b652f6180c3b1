"""The ``vllm.endpoint_plugins`` entry: ``/torpor/state`` and ``/torpor/events`` on vLLM's API server.

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS`` (``VLLM_PLUGINS=torpor``;
list the general plugin too when the variable is set, as it filters every group).
The API server holds no controller: the workers do, and each writes its rank's
event log into the shared log directory (``TORPOR_LOG_DIR``). Both routes read
those logs and change nothing:

- ``GET /torpor/state[?engine=E]``: the engine-wide state merged from every
  rank (what ``torpor status DIR --json`` prints);
- ``GET /torpor/events?[engine=E][&rank=N][&after=SEQ][&limit=L][&wait=S]``: the
  rank's events after ``SEQ``, oldest first, in the same shape and with the
  same parameters as the standalone endpoint's ``/events`` (NDJSON, headers
  ``X-Torpor-Last-Seq``/``-First-Seq``/``-Engine``/``-Rank``; see
  :mod:`torpor.telemetry.feed`); with ``wait`` it waits up to ``S`` seconds (at
  most 30) for a new one (long poll, for RL controllers).

Each rank log is read by one :class:`~torpor.statemachine.log.logsource.LogSource` per
API server (the tailer ``torpor log follow`` uses), started at the first
request for it: every request answers from its recent events, and a long-poll
waits for its next event, never re-reading the log. ``/torpor/state`` keeps one
follower and projection per rank log too, so a request reads only what was
appended since the last one, not every rank's log again. At most ``MAX_WAITERS``
long-polls wait at once (503 beyond); one whose client hangs up leaves at once.

A bad parameter gets a 400 naming it; a directory without logs a 404; a log
stuck at a bad line a 503 naming file and line.
This module imports FastAPI (vLLM's server framework); only vLLM's plugin
loader imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from torpor.errors import BadRequest, TorporError
from torpor.hooks.vllm.settings import default_log_dir
from torpor.readmodel.ranklogs import FleetError, FleetView, fleet, rank_follower, rank_logs
from torpor.statemachine.log.follow import Follower
from torpor.statemachine.log.logsource import LogSource
from torpor.statemachine.log.segments import segments
from torpor.statemachine.projection.view import Projection, follow_on
from torpor.telemetry.feed import NDJSON, EventFeed, events_headers, events_query
from torpor.telemetry.server import source_error

MAX_WAIT = 30.0
MAX_LIMIT = 10_000
MAX_WAITERS = 32


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


class _RankStates:
    """One follower and projection per rank log for ``/torpor/state``: a request reads only what was appended.

    A follower starts at the snapshot that opens the rank's active file (as
    :func:`~torpor.readmodel.ranklogs.project_rank` does) and is kept; a rank whose log
    has a bad line is unreadable (naming file and line) until the line is repaired.
    A log that is gone is let go at the next request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[Path, tuple[Follower, Projection]] = {}

    def _read(self, path: Path) -> Projection:
        entry = self._ranks.get(path)
        if entry is None:
            entry = self._ranks[path] = (rank_follower(path), Projection())
        follower, proj = entry
        for event in follower.read_available():
            proj = follow_on(proj, event)
        self._ranks[path] = (follower, proj)
        return proj

    def view(self, directory: Path, engine: str | None) -> FleetView:
        """The engine-wide view of ``directory``, each rank log read from where the last request left it."""
        with self._lock:
            view = fleet(directory, engine=engine, read=self._read)
            for path in [p for p in self._ranks if not segments(p)]:
                self._ranks.pop(path)[0].close()
            return view

    def close(self) -> None:
        """Close every follower."""
        with self._lock:
            ranks, self._ranks = list(self._ranks.values()), {}
        for follower, _ in ranks:
            follower.close()


class _Tails:
    """One LogSource and its EventFeed per rank log, shared by every request of this API server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tails: dict[Path, tuple[LogSource, EventFeed]] = {}

    def get(self, path: Path) -> tuple[LogSource, EventFeed]:
        """The tail of ``path``, started (the log read once) on first use."""
        with self._lock:
            tail = self._tails.get(path)
            if tail is None:
                source = LogSource(path, poll=0.1, keep_events=MAX_LIMIT)
                tail = self._tails[path] = (source, EventFeed(source, keep=MAX_LIMIT))
            return tail

    def close(self) -> None:
        """Stop every tail."""
        with self._lock:
            tails, self._tails = list(self._tails.values()), {}
        for source, feed in tails:
            feed.close()
            source.close()


async def _wait_for_event(request: Request, feed: EventFeed, after: int, wait: float) -> bool:
    """Wait for an event above ``after`` (up to ``wait`` seconds); False when the client hung up."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + wait
    hang_up = asyncio.ensure_future(_disconnected(request))
    try:
        while (waker := feed.waker(after)) is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            fired: asyncio.Future[None] = loop.create_future()
            loop.add_reader(waker.fd, _resolve, fired)
            try:
                done, _ = await asyncio.wait({fired, hang_up}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                loop.remove_reader(waker.fd)
                fired.cancel()
            if hang_up in done:
                return False
            if not done:
                return True
        return True
    finally:
        hang_up.cancel()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _disconnected(request: Request) -> None:
    """Return once the client disconnects (ASGI ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _close_at_shutdown(app: FastAPI, close: Callable[[], None]) -> None:
    """Run ``close`` when the app's lifespan ends.

    vLLM's ``EndpointPlugin`` has no shutdown call, and its API server passes
    its own ``lifespan`` to FastAPI, which makes shutdown event handlers never
    run; so the app's lifespan is wrapped instead.
    """
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(target: Any) -> AsyncIterator[Any]:
        async with inner(target) as state:
            try:
                yield state
            finally:
                close()

    app.router.lifespan_context = lifespan


class TorporEndpointPlugin:
    """vLLM ``EndpointPlugin``: read-only torpor routes on the API server."""

    name = "torpor"
    required_tasks = None

    def __init__(self, log_dir: str | Path | None = None) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.tails = _Tails()
        self.states = _RankStates()
        #: ``/torpor/events`` long-polls waiting right now (at most ``MAX_WAITERS``).
        self.waiting = 0

    def close(self) -> None:
        """Stop every rank log's tail (the routes start them again when asked)."""
        self.tails.close()
        self.states.close()

    def directory(self, request: Request) -> Path:
        """The shared log directory: this plugin's, the app state's, else ``TORPOR_LOG_DIR``'s default."""
        if self.log_dir is not None:
            return self.log_dir
        stored = getattr(request.app.state, "torpor_log_dir", None)
        return Path(stored) if stored else default_log_dir()

    def attach_router(self, app: FastAPI) -> None:
        """Add ``GET /torpor/state`` and ``GET /torpor/events``; the app's shutdown closes the tails."""
        _close_at_shutdown(app, self.close)
        router = APIRouter()

        def error(status: int, reason: str) -> JSONResponse:
            return JSONResponse({"error": reason}, status_code=status)

        @router.get("/torpor/state")
        async def torpor_state(request: Request) -> JSONResponse:
            """The engine-wide sleep state merged from the per-rank event logs."""
            engine = request.query_params.get("engine") or None
            try:
                view = await asyncio.to_thread(self.states.view, self.directory(request), engine)
            except FleetError as exc:
                return error(404, str(exc))
            except (TorporError, OSError) as exc:  # a log with a bad line: say which, never a traceback
                return error(503, str(exc))
            return JSONResponse(view.to_dict())

        @router.get("/torpor/events")
        async def torpor_events(request: Request) -> Response:
            """One rank's events after a sequence number (NDJSON), optionally waiting for the next one."""
            try:
                query = events_query(request.query_params, max_wait=MAX_WAIT, max_events=MAX_LIMIT)
                path = _rank_log(self.directory(request), query.engine, query.rank or 0)
            except BadRequest as exc:
                return error(400, str(exc))
            except FleetError as exc:
                return error(404, str(exc))
            try:
                source, feed = await asyncio.to_thread(self.tails.get, path)
                await asyncio.to_thread(
                    source.refresh
                )  # what was appended since its last poll: as fresh as /torpor/state
            except (TorporError, OSError, ValueError) as exc:
                return error(503, f"cannot read {path}: {exc}")
            batch = feed.batch(query.after, query.limit)
            if not batch.count and query.wait > 0 and source_error(source) is None:
                if self.waiting >= MAX_WAITERS:
                    return JSONResponse(
                        {"error": "too many /torpor/events requests are waiting; retry later"},
                        status_code=503,
                        headers={"Retry-After": "1"},
                    )
                self.waiting += 1
                try:
                    if not await _wait_for_event(request, feed, query.after, query.wait):
                        return Response(status_code=499)  # the client is gone: nobody reads this
                finally:
                    self.waiting -= 1
                batch = feed.batch(query.after, query.limit)
            stuck = source_error(source)
            if not batch.count and stuck is not None:
                return error(503, f"stuck: {path} cannot be read past event #{batch.latest}: {stuck}")
            headers = events_headers(batch, source.engine, source.rank) | {"Cache-Control": "no-store"}
            return Response(batch.body, media_type=NDJSON, headers=headers)

        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        """Remember the log directory the routes read (``TORPOR_LOG_DIR`` as the server started)."""
        state.torpor_log_dir = str(self.log_dir or default_log_dir())


def endpoint_plugin() -> TorporEndpointPlugin:
    """The ``vllm.endpoint_plugins`` entry point: a zero-argument factory."""
    return TorporEndpointPlugin()
