"""A read-only HTTP endpoint: ``/metrics`` for Prometheus, ``/state`` and ``/events`` (long-poll) for RL controllers.

``serve(source, port)`` runs a small stdlib HTTP server in a daemon thread.
Every route is a GET that reads; other methods get 405. It binds loopback
unless told otherwise. Requests and responses are bounded: URLs up to 4 KiB,
at most ``max_events`` events per response, long-polls up to ``max_wait``
seconds and at most ``max_waiters`` at once (503 beyond), a socket timeout
against idle clients. A bad or unknown query parameter gets a 400 naming it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from torpor.statemachine.events import Event
from torpor.telemetry.tracker import Source

logger = logging.getLogger("torpor.telemetry")

MAX_URL = 4096
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class BadRequest(ValueError):
    """A query the endpoint refuses; the message is the 400 body's reason."""


def int_param(params: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    """The integer query parameter ``name`` within ``low..high`` (``default`` when absent), else :class:`BadRequest`."""
    raw = params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()):  # str.isdigit alone takes "²", which int() refuses
        msg = f"{name} must be a non-negative integer, got {raw[:40]!r}"
        raise BadRequest(msg)
    digits = raw.lstrip("0") or "0"
    if len(digits) > len(str(high)):  # beyond the range; and int() refuses over 4300 digits
        msg = f"{name} must be between {low} and {high}, got {raw[:40]}{'...' if len(raw) > 40 else ''}"
        raise BadRequest(msg)
    value = int(digits)
    if not low <= value <= high:
        msg = f"{name} must be between {low} and {high}, got {value}"
        raise BadRequest(msg)
    return value


def seconds_param(params: Mapping[str, str], name: str, default: float, high: float) -> float:
    """The seconds query parameter ``name`` within ``0..high`` (``default`` when absent), else :class:`BadRequest`."""
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        msg = f"{name} must be a number of seconds, got {raw[:40]!r}"
        raise BadRequest(msg) from None
    if not 0.0 <= value <= high:  # also refuses nan
        msg = f"{name} must be between 0 and {high:g} seconds, got {raw[:40]!r}"
        raise BadRequest(msg)
    return value


def parse_query(query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """Query parameters as a dict; unknown, repeated or malformed ones raise :class:`BadRequest`."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=len(allowed) + 1)
    except ValueError as exc:
        msg = f"malformed query string ({exc})"
        raise BadRequest(msg) from None
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            known = ", ".join(allowed) or "none"
            msg = f"unknown query parameter {name[:40]!r}; this route takes: {known}"
            raise BadRequest(msg)
        if name in params:
            msg = f"query parameter {name!r} given more than once"
            raise BadRequest(msg)
        params[name] = value
    return params


class _Feed:
    """Wakes long-polling ``/events`` requests when the source records an event."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.changed = threading.Condition()
        self.latest = source.projection.last_seq
        self.closed = False
        self._unsubscribe = source.subscribe(self._on_event)

    def _on_event(self, event: Event) -> None:
        with self.changed:
            self.latest = max(self.latest, event.seq)
            self.changed.notify_all()

    def wait_after(self, after: int, timeout: float) -> None:
        """Block until an event above ``after`` exists, the timeout passes, or the server closes."""
        with self.changed:
            self.changed.wait_for(lambda: self.closed or self.latest > after, timeout)

    def close(self) -> None:
        self._unsubscribe()
        with self.changed:
            self.closed = True
            self.changed.notify_all()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # set by serve():
    torpor: Server


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = 10.0  # seconds a client may sit idle on its socket
    protocol_version = "HTTP/1.1"
    server_version = "torpor"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        body = (json.dumps({"error": reason, "status": status}) + "\n").encode()
        self._send(status, body, "application/json", headers)

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
        on_close: Callable[[], None] | None = None,
        render: Callable[[], bytes] | None = None,
    ) -> None:
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
        self.feed = _Feed(source) if source is not None else None
        self.routes: dict[str, Callable[[_Handler, str], None]] = {"/metrics": self._metrics}
        if source is not None:
            self.routes.update({"/state": self._state, "/events": self._events})
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.torpor = self
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
        encoder, content_type = choose_encoder(handler.headers.get("Accept", ""))
        if self._render is not None and content_type.startswith("text/plain"):
            body = self._render()  # torpor's own registry: the collector renders the text format directly
        else:
            body = encoder(self.registry)
        handler._send(200, body, content_type)

    def _state(self, handler: _Handler, query: str) -> None:
        parse_query(query, ())
        if self.source is None:
            handler._error(404, "no source: this endpoint serves /metrics only")
            return
        body = json.dumps(self.source.projection.to_dict(), sort_keys=True).encode() + b"\n"
        handler._send(200, body, "application/json")

    def _events(self, handler: _Handler, query: str) -> None:
        params = parse_query(query, ("after", "timeout", "limit"))
        after = int_param(params, "after", 0, 0, 2**63 - 1)
        timeout = seconds_param(params, "timeout", 0.0, self.max_wait)
        limit = int_param(params, "limit", self.max_events, 1, self.max_events)
        if self.source is None or self.feed is None:
            handler._error(404, "no source: this endpoint serves /metrics only")
            return
        events = self.source.events(after)
        if not events and timeout > 0:
            if not self._waiters.acquire(blocking=False):
                handler._error(503, "too many /events requests are waiting; retry later", {"Retry-After": "1"})
                return
            with self._count_lock:
                self.waiting += 1
            try:
                self.feed.wait_after(after, timeout)
            finally:
                with self._count_lock:
                    self.waiting -= 1
                self._waiters.release()
            events = self.source.events(after)
        events = events[:limit]
        body = "".join(e.to_json() + "\n" for e in events).encode()
        headers = {"X-Torpor-Last-Seq": str(self.source.projection.last_seq)}
        if events:
            headers["X-Torpor-First-Seq"] = str(events[0].seq)
        handler._send(200, body, "application/x-ndjson", headers)

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
) -> Server:
    """Serve ``/metrics``, ``/state`` and ``/events`` for ``source`` on ``host:port`` (0 picks a free port).

    ``registry`` is exposed as given; by default the endpoint exposes a
    private registry with torpor's collector for ``source`` (or, in
    multiprocess mode, the merged files of ``PROMETHEUS_MULTIPROC_DIR``).
    ``source`` None serves ``/metrics`` only (an API server in multiprocess mode); a
    path serves an event log written by another process (:class:`~torpor.telemetry.replay.LogSource`).
    """
    from torpor.telemetry import attach, multiprocess
    from torpor.telemetry.replay import LogSource, resolve_log

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
    return Server(
        source,
        port,
        host,
        registry,
        max_wait=max_wait,
        max_events=max_events,
        max_waiters=max_waiters,
        on_close=lambda: _close_all(closers),
        render=render,
    )
