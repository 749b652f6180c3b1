"""A read-only HTTP endpoint: ``/metrics`` for Prometheus, ``/state`` and ``/events`` (long-poll) for RL controllers.

``serve(source, port)`` runs a small stdlib HTTP server in a daemon thread.
Every route is a GET that reads; other methods get 405. It binds loopback
unless told otherwise (``host="::1"`` binds IPv6). What a client can make the
engine hold is bounded (:mod:`torpor.telemetry.admission`): at most
``max_connections`` connections (a thread each; when full, the one waiting
longest for its request head makes room, else 503 with ``Retry-After``),
request heads of at most 16 KiB and 64 headers, each within ``read_timeout``
seconds however slowly it trickles in (408), URLs up to 4 KiB, at most
``max_events`` events per response, long-polls up to ``max_wait`` seconds and
at most ``max_waiters`` at once (fewer than ``max_connections``; 503 with
``Retry-After: 1`` beyond), and every response within 10 s (a connection
blocked in a write, a client that does not read, is the first dropped to make
room for a newcomer, so scrapes keep answering). A bad or unknown query
parameter gets a 400 naming it. A client that hangs up costs nothing: its
long-poll ends (and frees its slot) at once (:mod:`torpor.telemetry.longpoll`),
and nothing is printed.

Serving costs the engine as little as it can: ``/events`` reads the
endpoint's own copy of the recent events with each event's JSON encoded once
(:class:`~torpor.telemetry.feed.EventFeed`), ``/state`` is encoded once per
event, ``/metrics`` takes the fast renderer for every scrape that accepts the
text format (:mod:`torpor.telemetry.negotiate`), gzip when asked.

``/events`` answers NDJSON (see :mod:`torpor.telemetry.feed`), the same shape
and parameters as the vLLM route ``/torpor/events``. When the source is a log
that stopped at a bad line (:attr:`LogSource.error <torpor.statemachine.log.logsource.LogSource.error>`),
``/state`` answers 503 with the error and the last good state, and ``/events``
503 once nothing newer can come.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.registry import CollectorRegistry

from torpor.errors import BadArgument, BadRequest
from torpor.statemachine.log.logsource import LogSource, resolve_log
from torpor.telemetry import multiprocess, negotiate
from torpor.telemetry.admission import Admission, BoundedHandler, BoundedServer
from torpor.telemetry.feed import (
    EVENTS_PARAMS,
    NDJSON,
    EventFeed,
    events_headers,
    events_query,
    int_param,
    parse_query,
    seconds_param,
)
from torpor.telemetry.longpoll import wait_for_event
from torpor.telemetry.session import attach
from torpor.telemetry.tracker import Source

logger = logging.getLogger("torpor.telemetry")

MAX_URL = 4096
#: Events the endpoint keeps for ``/events`` (at least; more when ``max_events`` is larger): a controller's default window.
KEEP_EVENTS = 10_000
LOOPBACK = ("127.0.0.1", "::1", "localhost")

__all__ = ["BadRequest", "Server", "int_param", "parse_query", "seconds_param", "serve"]


def source_error(source: object) -> Exception | None:
    """The error a log source is stuck at (:attr:`LogSource.error`), else None."""
    error = getattr(source, "error", None)
    return error if isinstance(error, Exception) else None


class _HTTPServer(BoundedServer):
    allow_reuse_address = True
    # set by serve():
    torpor: Server

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or stalls is routine: a debug line, never a traceback on stderr."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError | TimeoutError):
            logger.debug("client %s went away: %s", client_address, exc)
            return
        logger.exception("torpor endpoint: request from %s failed", client_address)


class _HTTPServer6(_HTTPServer):
    address_family = socket.AF_INET6


class _Handler(BoundedHandler):
    server: _HTTPServer
    timeout = 10.0  # seconds a response may take to go out (a client that does not read)
    reserved_paths = frozenset({"/metrics"})  # a scrape gets in even when every connection is busy
    server_version = "torpor"
    # Headers and body go out in two writes: with Nagle on, a small body waits for the client's delayed ACK (40 ms).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        if len(self.path) > MAX_URL:
            self._error(414, f"URL is {len(self.path)} bytes, over the {MAX_URL}-byte limit")
            return
        parts = urlsplit(self.path)
        route = self.server.torpor.routes.get(parts.path)
        if route is None:
            known = ", ".join(sorted(self.server.torpor.routes))
            self._error(404, f"no route {parts.path[:80]!r}; routes: {known}")
            return
        try:
            route(self, parts.query)
        except BadRequest as exc:
            self._error(400, str(exc))

    do_HEAD = do_GET

    def _read_only(self) -> None:
        self.close_connection = True  # its body, if any, is never read
        self._error(405, f"{self.command} refused: this endpoint is read-only", {"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _read_only


class Server:
    """A running endpoint: ``url``, ``port``, ``close()``; also a context manager."""

    def __init__(
        self,
        source: Source | None,
        port: int,
        host: str,
        registry: CollectorRegistry,
        *,
        max_wait: float,
        max_events: int,
        max_waiters: int,
        max_connections: int = 64,
        read_timeout: float = 10.0,
        on_close: Callable[[], None] | None = None,
        render: Callable[[], bytes] | None = None,
    ) -> None:
        if not 0 < max_waiters < max_connections:
            msg = (
                f"max_waiters={max_waiters} refused: long-polls must leave connections for other requests "
                f"(0 < max_waiters < max_connections={max_connections})"
            )
            raise BadArgument(msg)
        if not (math.isfinite(read_timeout) and read_timeout > 0):
            msg = f"read_timeout={read_timeout!r} refused: a positive number of seconds"
            raise BadArgument(msg)
        self.source = source
        self._render = render
        self.registry = registry
        self.max_wait = max_wait
        self.max_events = max_events
        self._waiters = threading.BoundedSemaphore(max_waiters)
        self._count_lock = threading.Lock()
        #: ``/events`` long-polls waiting right now.
        self.waiting = 0
        self._on_close = on_close
        self.feed = EventFeed(source, keep=max(max_events, KEEP_EVENTS)) if source is not None else None
        self._state_cache: tuple[int, bytes] = (-1, b"")
        self.routes: dict[str, Callable[[_Handler, str], None]] = {"/metrics": self._metrics}
        if source is not None:
            self.routes.update({"/state": self._state, "/events": self._events})
        server_class = _HTTPServer6 if ":" in host else _HTTPServer
        handler = type("_Handler", (_Handler,), {"read_timeout": float(read_timeout)})
        try:
            self._httpd = server_class((host, port), handler)
        except BaseException:
            if self.feed is not None:
                self.feed.close()
            raise
        self._httpd.torpor = self
        #: The connections: ``active``, and how many were ``refused`` (503) or ``evicted`` to make room.
        self.admission = self._httpd.admission = Admission(max_connections)
        self.host = host
        self.port = int(self._httpd.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{self.port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.1,), name=f"torpor-telemetry:{self.port}", daemon=True
        )
        self._thread.start()
        if host not in LOOPBACK:
            logger.warning("torpor telemetry endpoint listens on %s:%d, beyond loopback", host, self.port)

    def _metrics(self, handler: _Handler, query: str) -> None:
        parse_query(query, ())
        accept = handler.headers.get("Accept", "")
        if negotiate.wants_text(accept):
            content_type = negotiate.TEXT
            body = self._render() if self._render is not None else generate_latest(self.registry)
        else:
            try:
                encoder, content_type = choose_encoder(accept)
            except (TypeError, ValueError):  # prometheus_client trips on some versions (version=abc)
                encoder, content_type = choose_encoder("application/openmetrics-text")
            body = encoder(self.registry)
        headers = {"Vary": "Accept, Accept-Encoding"}
        if negotiate.wants_gzip(handler.headers.get("Accept-Encoding", "")):
            body = negotiate.compress(body)
            headers["Content-Encoding"] = "gzip"
        handler._send(200, body, content_type, headers)

    def _state(self, handler: _Handler, query: str) -> None:
        parse_query(query, ())
        if self.source is None:
            handler._error(404, "no source: this endpoint serves /metrics only")
            return
        projection = self.source.projection
        seq, body = self._state_cache
        if seq != projection.last_seq or not body:
            body = json.dumps(projection.to_dict(), sort_keys=True).encode() + b"\n"
            self._state_cache = (projection.last_seq, body)
        error = source_error(self.source)
        if error is not None:
            reason = f"stuck: the log cannot be read past event #{projection.last_seq}: {error}"
            handler._error(503, reason, {"X-Torpor-Stuck": "1"}, stuck=True, state=json.loads(body))
            return
        handler._send(200, body, "application/json")

    def _check_identity(self, engine: str | None, rank: int | None) -> None:
        source = self.source
        if source is None:
            return
        own_engine = str(getattr(source, "engine", "") or source.projection.engine)
        own_rank = int(getattr(source, "rank", source.projection.rank))
        if engine is not None and engine != own_engine:
            msg = f"this endpoint serves engine {own_engine!r}, not {engine[:80]!r}"
            raise BadRequest(msg)
        if rank is not None and rank != own_rank:
            msg = f"this endpoint serves rank {own_rank}, not rank {rank}"
            raise BadRequest(msg)

    def _events(self, handler: _Handler, query: str) -> None:
        q = events_query(parse_query(query, EVENTS_PARAMS), max_wait=self.max_wait, max_events=self.max_events)
        self._check_identity(q.engine, q.rank)
        feed = self.feed
        if self.source is None or feed is None:
            handler._error(404, "no source: this endpoint serves /metrics only")
            return
        batch = feed.batch(q.after, q.limit)
        if not batch.count and q.wait > 0 and source_error(self.source) is None:
            if not self._waiters.acquire(blocking=False):
                handler._error(503, "too many /events requests are waiting; retry later", {"Retry-After": "1"})
                return
            with self._count_lock:
                self.waiting += 1
            try:
                if not wait_for_event(feed, q.after, q.wait, handler.connection, self._stuck):
                    handler.close_connection = True
                    return  # the client hung up: nobody to answer
            finally:
                with self._count_lock:
                    self.waiting -= 1
                self._waiters.release()
            batch = feed.batch(q.after, q.limit)
        error = source_error(self.source)
        if not batch.count and error is not None:
            handler._error(503, f"stuck: the log cannot be read past event #{batch.latest}: {error}", stuck=True)
            return
        engine = str(getattr(self.source, "engine", "") or self.source.projection.engine)
        rank = getattr(self.source, "rank", self.source.projection.rank)
        handler._send(200, batch.body, NDJSON, events_headers(batch, engine, rank))

    def _stuck(self) -> bool:
        return source_error(self.source) is not None

    def close(self) -> None:
        """Stop serving, wake long-polls, and detach what :func:`serve` attached."""
        if self.feed is not None:
            self.feed.close()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_all(closers: list[Callable[[], None]]) -> None:
    for close in closers:
        close()


def serve(
    source: Source | str | os.PathLike[str] | None,
    port: int = 0,
    host: str = "127.0.0.1",
    *,
    registry: CollectorRegistry | None = None,
    max_wait: float = 30.0,
    max_events: int = 10_000,
    max_waiters: int = 32,
    max_connections: int = 64,
    read_timeout: float = 10.0,
) -> Server:
    """Serve ``/metrics``, ``/state`` and ``/events`` for ``source`` on ``host:port`` (0 picks a free port).

    ``registry`` is exposed as given; by default the endpoint exposes a
    private registry with torpor's collector for ``source`` (or, in
    multiprocess mode, the merged files of ``PROMETHEUS_MULTIPROC_DIR``).
    ``source`` None serves ``/metrics`` only (an API server in multiprocess mode); a
    path serves an event log written by another process (:class:`~torpor.statemachine.log.logsource.LogSource`).
    ``max_connections`` bounds the connections (threads) clients can hold and
    ``read_timeout`` the seconds a request head may take (see the module docstring).
    """
    closers: list[Callable[[], None]] = []
    render: Callable[[], bytes] | None = None
    if isinstance(source, str | os.PathLike):
        source = LogSource(resolve_log(source))
        closers.append(source.close)
    if registry is None:
        if multiprocess.enabled():
            registry = multiprocess.multiprocess_registry()
        else:
            registry = CollectorRegistry()
            if source is not None:
                handle = attach(source, registry=registry, otel=False, multiprocess=False)
                closers.insert(0, handle.detach)
                render = handle.collector.exposition if handle.collector is not None else None
    try:
        return Server(
            source,
            port,
            host,
            registry,
            max_wait=max_wait,
            max_events=max_events,
            max_waiters=max_waiters,
            max_connections=max_connections,
            read_timeout=read_timeout,
            on_close=lambda: _close_all(closers),
            render=render,
        )
    except BaseException:
        _close_all(closers)
        raise
