"""What any client can make the endpoint hold: connections, request heads, time.

The endpoint (:mod:`torpor.telemetry.server`) runs in the engine's process,
so every byte and thread a client makes it hold is the engine's. This module
bounds them:

- **connections**: at most ``max_connections`` (64) at once, one thread each.
  A new connection beyond that takes the place of the one blocked longest in a
  write (a client that does not read its answers: blocked for more than
  :data:`STALLED_WRITE` seconds), else of the one that has waited longest for
  its request head (idle keep-alive or stalled: the cheapest to drop). So a
  scrape that sends its request at once always gets in, even while slow readers
  pipeline requests and never read (issue 37). When every connection is busy
  in a request and none is stalled, up to :data:`RESERVED` (2) more are taken
  for the handler's ``reserved_paths`` only (the endpoint's ``/metrics``: a
  scrape still answers; any other request there gets 503 and the connection
  closes after one answer). Beyond those, the newcomer is answered
  ``503 Service Unavailable`` with ``Retry-After: 1`` and ``Connection: close``
  at once, without a thread, and its socket is drained and closed by the
  server loop a moment later (so the client reads the 503, not a reset);
- **the request head**: read by :func:`~torpor.telemetry.requesthead.read_head` into one buffer of at most
  :data:`~torpor.telemetry.requesthead.MAX_HEAD_BYTES` (16 KiB, request line and headers), at most
  :data:`~torpor.telemetry.requesthead.MAX_HEADERS` (64) header lines, a request line of at most
  :data:`~torpor.telemetry.requesthead.MAX_REQUEST_LINE` (8 KiB): beyond, 431 or 414 and the connection
  closes. A head whose framing says a body follows (or says it ambiguously) gets 400 and the connection
  closes, its body never read as a request (:func:`~torpor.telemetry.requesthead.framing_problem`);
- **time**: the whole head must arrive within ``read_timeout`` (10 s) of the
  connection or of the previous response, however it trickles in (slowloris):
  else 408 (or, when nothing came, a silent close of the idle connection).
  A whole response (head and body) must go out within the handler's
  ``timeout`` (10 s) however slowly the client reads: else the connection closes.

Long-polls are bounded by the endpoint itself (``max_waiters`` slots, fewer than
``max_connections``, so they can never hold every connection).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from torpor.errors import BadArgument, ConnectionShed, ResponseStalled
from torpor.telemetry.requesthead import CLOSED, HEAD_REFUSED, OK, TIMEOUT, framing_problem, read_head

#: Refused connections kept at once while their 503 goes out (beyond: the oldest closes now).
MAX_LINGERING = 256
LINGER_SECONDS = 1.0
#: Seconds a connection must have been blocked in one write before a newcomer may take its place.
STALLED_WRITE = 0.5
#: Connections beyond ``max_connections`` kept for the handler's ``reserved_paths`` (scrapes), one request each.
RESERVED = 2
#: A response header value as sent: visible ASCII words, single spaces or tabs between (no CR, LF or other control).
_FIELD_VALUE = re.compile(r"[\x21-\x7e]*(?:[ \t]+[\x21-\x7e]+)*")


def busy_response(reason: str) -> bytes:
    """A whole ``503`` answer with ``Retry-After: 1`` that closes the connection."""
    body = (json.dumps({"error": reason, "status": 503}, sort_keys=True) + "\n").encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nServer: torpor\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Admission:
    """The connections of one endpoint: admits, evicts the longest-waiting head reader when full, refuses beyond."""

    def __init__(self, max_connections: int, reserved: int = RESERVED) -> None:
        self.max_connections = max_connections
        self.reserved = reserved
        self._lock = threading.Lock()
        self._reserve: set[socket.socket] = set()  # connections admitted beyond the limit, for reserved paths only
        self.active = 0
        self._reading: dict[socket.socket, float] = {}  # connection -> when it started waiting for a head
        self._writing: dict[socket.socket, float] = {}  # connection -> when its current write started
        self._evicted: set[socket.socket] = set()
        self._lingering: deque[tuple[socket.socket, float]] = deque()
        #: Connections turned away (503) and connections dropped to make room, since the start.
        self.refused = 0
        self.evicted = 0

    def admit(self, sock: socket.socket) -> bool:
        """Take ``sock`` (True), making room by dropping a stalled writer or the longest head reader; False: refuse it."""
        victim = None
        with self._lock:
            if self.active >= self.max_connections:
                victim = self._victim_locked()
                if victim is None:
                    if len(self._reserve) >= self.reserved:
                        return False
                    self._reserve.add(sock)
                    self.active += 1
                    return True
                self._reading.pop(victim, None)
                self._writing.pop(victim, None)
                self._evicted.add(victim)
                self.evicted += 1
            self.active += 1
        if victim is not None:
            with contextlib.suppress(OSError):  # its thread's recv or send returns at once; the thread closes it
                victim.shutdown(socket.SHUT_RDWR)
        return True

    def _victim_locked(self) -> socket.socket | None:
        """The connection to drop for a newcomer: blocked longest in a write (past STALLED_WRITE), else longest reader."""
        stalled_since = time.monotonic() - STALLED_WRITE
        stalled = [s for s, since in self._writing.items() if since <= stalled_since]
        if stalled:
            return min(stalled, key=self._writing.__getitem__)
        if self._reading:
            return min(self._reading, key=self._reading.__getitem__)
        return None

    def reading(self, sock: socket.socket) -> None:
        """``sock``'s thread waits for a request head: it may be dropped to make room."""
        with self._lock:
            if sock not in self._evicted:
                self._reading[sock] = time.monotonic()

    def done_reading(self, sock: socket.socket) -> bool:
        """``sock`` has its head (or gave up): no longer droppable; False when it was dropped meanwhile."""
        with self._lock:
            self._reading.pop(sock, None)
            return sock not in self._evicted

    def in_reserve(self, sock: socket.socket) -> bool:
        """True when ``sock`` was admitted beyond the limit: it may ask for a reserved path, once."""
        with self._lock:
            return sock in self._reserve

    def writing(self, sock: socket.socket) -> bool:
        """``sock``'s thread starts a write: blocked in it too long, it may be dropped; False when it was dropped."""
        with self._lock:
            if sock in self._evicted:
                return False
            self._writing[sock] = time.monotonic()
            return True

    def done_writing(self, sock: socket.socket) -> None:
        """``sock``'s write went out (or failed)."""
        with self._lock:
            self._writing.pop(sock, None)

    def release(self, sock: socket.socket) -> None:
        """``sock``'s thread is done with it."""
        with self._lock:
            self._reading.pop(sock, None)
            self._writing.pop(sock, None)
            self._reserve.discard(sock)
            self._evicted.discard(sock)
            self.active -= 1

    def refuse(self, sock: socket.socket) -> None:
        """Answer 503 + Retry-After without a thread; the socket lingers (drained) until :meth:`service` closes it."""
        self.refused += 1
        try:
            sock.setblocking(False)
            self._drain(sock)
            sock.send(busy_response(f"busy: all {self.max_connections} connections are in use; retry later"))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        self._lingering.append((sock, time.monotonic()))
        while len(self._lingering) > MAX_LINGERING:
            self._lingering.popleft()[0].close()

    @staticmethod
    def _drain(sock: socket.socket) -> bool:
        """Read and drop what the peer sent (a close with unread bytes would reset the 503); True at its EOF."""
        for _ in range(16):
            try:
                if not sock.recv(65536):
                    return True
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return True
        return False

    def service(self) -> None:
        """Close refused sockets whose peer hung up or whose moment has passed (the server loop calls this)."""
        now = time.monotonic()
        keep: deque[tuple[socket.socket, float]] = deque()
        while self._lingering:
            sock, since = self._lingering.popleft()
            if self._drain(sock) or now - since > LINGER_SECONDS:
                sock.close()
            else:
                keep.append((sock, since))
        self._lingering = keep

    def close(self) -> None:
        """Close every lingering refused socket."""
        while self._lingering:
            self._lingering.popleft()[0].close()


class BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server whose connections go through an :class:`Admission` (set ``admission`` before serving)."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections is accepted (and bounded here), not left to SYN retries
    admission: Admission

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.admission.admit(request):
            self.admission.refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.admission.release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.admission.release(request)

    def service_actions(self) -> None:
        self.admission.service()

    def server_close(self) -> None:
        super().server_close()
        admission = getattr(self, "admission", None)  # None when the bind itself failed
        if admission is not None:
            admission.close()


class DeadlineWriter(io.BufferedIOBase):
    """The handler's ``wfile``: each write must go out by the response's deadline; a write blocked past
    :data:`STALLED_WRITE` may be dropped to make room (:meth:`Admission.admit`)."""

    def __init__(self, sock: socket.socket, admission: Admission) -> None:
        super().__init__()
        self._sock = sock
        self._admission = admission
        self.deadline = float("inf")

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._sock.fileno()

    def write(self, b: Any) -> int:
        data = memoryview(b)
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            msg = "the response did not go out within the write timeout (the client does not read)"
            raise ResponseStalled(msg)
        if not self._admission.writing(self._sock):
            msg = "connection dropped to make room while its client was not reading"
            raise ConnectionShed(msg)
        try:
            self._sock.settimeout(remaining)
            self._sock.sendall(data)
        finally:
            self._admission.done_writing(self._sock)
        return len(data)


class BoundedHandler(BaseHTTPRequestHandler):
    """Reads each request head with :func:`read_head` (bounded in bytes, lines and time), refuses a body, then serves it."""

    server: BoundedServer
    protocol_version = "HTTP/1.1"
    #: Seconds a whole request head may take (the endpoint sets it per server).
    read_timeout = 10.0
    #: Paths a connection admitted beyond ``max_connections`` may ask for (the endpoint's ``/metrics``).
    reserved_paths: frozenset[str] = frozenset()

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # heads are read from the socket by read_head; each one's headers parse from memory
        self.rfile = io.BytesIO()
        self._pending = b""  # bytes of a pipelined next request read with the last head
        self._writer = DeadlineWriter(self.connection, self.server.admission)
        self.wfile = self._writer  # type: ignore[assignment]

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        raw = [name for name, value in (headers or {}).items() if not _FIELD_VALUE.fullmatch(value)]
        if raw:  # a route passed data unencoded: nothing goes out rather than a forged or broken head
            msg = f"header(s) {', '.join(raw)} refused: a value must be visible ASCII (encode_header_value); nothing was sent"
            raise BadArgument(msg)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, reason: str, headers: dict[str, str] | None = None, **extra: Any) -> None:
        body = (json.dumps({"error": reason, "status": status, **extra}, sort_keys=True) + "\n").encode()
        self._send(status, body, "application/json", headers)

    def handle_expect_100(self) -> bool:
        """Never invite a body with ``100 Continue``: this endpoint reads none (a request with one is refused 400)."""
        return True

    def handle_one_request(self) -> None:
        try:
            self._handle_one()
        except TimeoutError:  # a write the client would not read
            self.close_connection = True

    def _handle_one(self) -> None:
        admission, sock = self.server.admission, self.connection
        admission.reading(sock)
        got = read_head(sock, self._pending, self.read_timeout)
        kept = admission.done_reading(sock)
        sock.settimeout(self.timeout)
        self._writer.deadline = time.monotonic() + (self.timeout if self.timeout is not None else float("inf"))
        self.close_connection = True
        if not kept or got.outcome == CLOSED or (got.outcome == TIMEOUT and not got.partial):
            return  # dropped to make room, hung up, or idle past the timeout: nobody waits for an answer
        if got.outcome != OK:
            self.requestline, self.request_version, self.command = "", "HTTP/1.1", ""
            status, reason = HEAD_REFUSED[got.outcome]
            self._error(status, reason, {"Connection": "close"})
            return
        self.close_connection = False
        self._pending = got.rest
        line, _, headers = got.head.partition(b"\n")
        self.raw_requestline = line + b"\n"
        self.rfile = io.BytesIO(headers)
        if not self.parse_request():
            return
        problem = framing_problem(headers, self.command)
        if problem is not None:  # what follows the head could be read as another request: never keep the connection
            self.close_connection = True
            self._error(400, problem, {"Connection": "close"})
            return
        if admission.in_reserve(sock):  # beyond the limit: one answer, and only for a reserved path
            self.close_connection = True
            if urlsplit(self.path).path not in self.reserved_paths:
                reason = f"busy: all {admission.max_connections} connections are in use; retry later"
                self._error(503, reason, {"Retry-After": "1", "Connection": "close"})
                return
        method = getattr(self, "do_" + self.command, None)
        if method is None:
            self.send_error(501, f"Unsupported method ({self.command!r})")
            return
        method()
        self.wfile.flush()
