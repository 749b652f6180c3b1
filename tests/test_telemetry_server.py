"""Tests for torpor.telemetry.server: /metrics, /state and /events, read-only, loopback, bounded, 400 on bad input."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge
from support import real_prometheus

from torpor import SleepController
from torpor.telemetry import Server, serve
from torpor.telemetry.server import BadRequest, parse_query
from torpor.testing import FakeMemory

TAGS = {"weights": 4000, "kv_cache": 8000, "cudagraph": 300, "runtime": 50}


def fetch(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of one request (errors included)."""
    request = urllib.request.Request(url, method=method)  # noqa: S310 - loopback test server
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def wait_for_waiters(server: Server, n: int) -> None:
    """Block until ``n`` long-polls are waiting on ``server`` (fails after 10 s)."""
    deadline = time.monotonic() + 10
    while server.waiting < n:
        assert time.monotonic() < deadline, "the long-poll never started waiting"
        time.sleep(0.01)


@pytest.fixture
def controller() -> SleepController:
    """A controller over a FakeMemory."""
    return SleepController(FakeMemory(TAGS), engine="e", rank=0)


@pytest.fixture
def server(controller: SleepController) -> Iterator[Server]:
    """An endpoint serving ``controller`` on a free loopback port."""
    with serve(controller, 0) as srv:
        yield srv


def test_binds_loopback_by_default(server: Server) -> None:
    """Without a host the endpoint listens on 127.0.0.1 and reports its url and port."""
    assert server.host == "127.0.0.1"
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert server.port > 0


def test_metrics_serves_the_exposition(server: Server, controller: SleepController) -> None:
    """/metrics carries torpor's families with the controller's current state."""
    controller.sleep(1)
    status, headers, body = fetch(server.url + "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert b'torpor_state{state="asleep_l1",torpor_engine="e",torpor_rank="0"} 1.0' in body
    assert b"torpor_tag_bytes" in body


def test_metrics_can_serve_a_given_registry(controller: SleepController) -> None:
    """A registry passed to serve() is exposed as it is."""
    registry = CollectorRegistry()
    Gauge("other_thing", "a gauge from elsewhere", registry=registry).set(7)
    with serve(controller, 0, registry=registry) as srv:
        _, _, body = fetch(srv.url + "/metrics")
    assert b"other_thing 7.0" in body
    assert b"torpor_state" not in body


def test_state_is_the_projection_as_json(server: Server, controller: SleepController) -> None:
    """/state gives the state, since and per-tag residency."""
    controller.sleep(1)
    status, headers, body = fetch(server.url + "/state")
    state = json.loads(body)
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert state["state"] == "asleep_l1"
    assert state["since"] == controller.projection.since
    assert {k: state["residency"]["weights"][k] for k in ("resident", "host", "discarded")} == {
        "resident": 0,
        "host": 4000,
        "discarded": 0,
    }
    assert state["residency"]["kv_cache"]["discarded"] == 8000


def test_events_after_returns_json_lines(server: Server, controller: SleepController) -> None:
    """/events?after=N returns each later event as one JSON line, with the last sequence number in a header."""
    mark = controller.last_seq
    controller.sleep(1)
    status, headers, body = fetch(f"{server.url}/events?after={mark}")
    lines = [json.loads(line) for line in body.decode().splitlines()]
    assert status == 200
    assert [e["seq"] for e in lines] == list(range(mark + 1, controller.last_seq + 1))
    assert lines[0]["kind"] == "sleep_requested"
    assert headers["X-Torpor-Last-Seq"] == str(controller.last_seq)
    _, _, limited = fetch(f"{server.url}/events?after={mark}&limit=2")
    assert len(limited.splitlines()) == 2


def test_events_long_poll_returns_when_an_event_arrives(server: Server, controller: SleepController) -> None:
    """A long-poll with nothing new waits, and returns as soon as the controller records an event."""
    mark = controller.last_seq
    got: dict[str, Any] = {}

    def poll() -> None:
        start = time.monotonic()
        got["response"] = fetch(f"{server.url}/events?after={mark}&wait=20")
        got["waited"] = time.monotonic() - start

    thread = threading.Thread(target=poll)
    thread.start()
    wait_for_waiters(server, 1)
    time.sleep(0.2)
    controller.sleep(1)
    thread.join(timeout=15)
    status, _, body = got["response"]
    assert status == 200
    assert json.loads(body.splitlines()[0])["seq"] == mark + 1
    assert 0.2 < got["waited"] < 10


def test_events_long_poll_times_out_empty(server: Server, controller: SleepController) -> None:
    """A long-poll that sees no event returns an empty 200 after its timeout."""
    start = time.monotonic()
    status, _, body = fetch(f"{server.url}/events?after={controller.last_seq}&wait=0.3")
    assert status == 200
    assert body == b""
    assert time.monotonic() - start >= 0.25


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("/events?after=-1", "after must be a non-negative integer"),
        ("/events?after=abc", "after must be a non-negative integer"),
        ("/events?wait=999", "wait must be between 0 and 30 seconds"),
        ("/events?wait=nan", "wait must be between"),
        ("/events?wait=x", "wait must be a number of seconds"),
        ("/events?limit=0", "limit must be between 1 and"),
        ("/events?after=1&after=2", "given more than once"),
        ("/events?bogus=1", "unknown query parameter 'bogus'"),
        ("/state?x=1", "unknown query parameter 'x'"),
        ("/metrics?name=torpor_state", "unknown query parameter 'name'"),
    ],
)
def test_bad_parameters_get_400_with_the_reason(server: Server, query: str, reason: str) -> None:
    """Every malformed, out-of-range or unknown query parameter is a 400 whose body names the problem."""
    status, headers, body = fetch(server.url + query)
    assert status == 400
    assert headers["Content-Type"] == "application/json"
    assert reason in json.loads(body)["error"]


def test_unknown_route_is_404_listing_routes(server: Server) -> None:
    """An unknown path is a 404 that names the routes."""
    status, _, body = fetch(server.url + "/nope")
    assert status == 404
    assert "/events, /metrics, /state" in json.loads(body)["error"]


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_endpoint_is_read_only(server: Server, controller: SleepController, method: str) -> None:
    """Writing methods get 405 and change nothing."""
    before = controller.last_seq
    status, headers, _ = fetch(server.url + "/state", method=method)
    assert status == 405
    assert headers["Allow"] == "GET, HEAD"
    assert controller.last_seq == before


def test_overlong_url_is_refused(server: Server) -> None:
    """A URL over the limit is refused with 414."""
    status, _, _ = fetch(server.url + "/events?after=" + "1" * 5000)
    assert status == 414


def test_too_many_waiters_get_503(controller: SleepController) -> None:
    """Long-polls beyond max_waiters are turned away with 503 instead of holding more threads."""
    with serve(controller, 0, max_waiters=1) as srv:
        url = f"{srv.url}/events?after={controller.last_seq}&wait=5"
        first = threading.Thread(target=fetch, args=(url,))
        first.start()
        wait_for_waiters(srv, 1)
        status, headers, _ = fetch(url)
        controller.sleep(1)
        first.join(timeout=10)
    assert status == 503
    assert headers["Retry-After"] == "1"


def test_close_stops_serving_and_detaches(controller: SleepController) -> None:
    """After close the port refuses connections and the controller has no telemetry subscriber left."""
    srv = serve(controller, 0)
    url = srv.url
    srv.close()
    assert len(controller._recorder.subscribers) == 0
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/state", timeout=2)  # noqa: S310


def test_metrics_only_without_a_source() -> None:
    """serve(None) serves /metrics only; /state is not a route."""
    with serve(None, 0, registry=CollectorRegistry()) as srv:
        assert fetch(srv.url + "/metrics")[0] == 200
        assert fetch(srv.url + "/state")[0] == 404


def test_parse_query_accepts_known_parameters() -> None:
    """parse_query returns the known parameters and refuses a malformed pair."""
    assert parse_query("after=3&wait=1.5", ("after", "wait")) == {"after": "3", "wait": "1.5"}
    assert parse_query("", ("after",)) == {}
    with pytest.raises(BadRequest):
        parse_query("after", ("after",))


@pytest.mark.parametrize("raw", ["²", "١٢", "-1", "1e3", " 7", ""])
def test_int_param_refuses_anything_but_ascii_digits(raw: str) -> None:
    """Superscripts, other scripts' digits, signs, exponents and blanks are a BadRequest, never a server error."""
    from torpor.telemetry.server import BadRequest, int_param

    with pytest.raises(BadRequest, match="non-negative integer"):
        int_param({"after": raw}, "after", 0, 0, 10**9)


def test_int_param_refuses_huge_numbers_before_converting() -> None:
    """A 5000-digit value is out of range (a BadRequest), not int()'s digit-limit ValueError; zeros pad fine."""
    from torpor.telemetry.server import BadRequest, int_param

    with pytest.raises(BadRequest, match="between 0 and 1000"):
        int_param({"after": "9" * 5000}, "after", 0, 0, 1000)
    assert int_param({"after": "0" * 5000 + "12"}, "after", 0, 0, 1000) == 12
    assert int_param({"after": "1000"}, "after", 0, 0, 1000) == 1000


PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def _get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)  # noqa: S310 - loopback test server
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
        return response.status, dict(response.headers), response.read()


def test_prometheus_scrapes_get_the_fast_text_format(controller: SleepController, server: Server) -> None:
    """Prometheus's Accept (OpenMetrics preferred, text accepted) gets the directly rendered text format."""
    import gzip

    controller.sleep(1)
    status, headers, body = _get(server.url + "/metrics", {"Accept": PROMETHEUS_ACCEPT})
    assert status == 200
    assert headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b'torpor_state{state="asleep_l1",torpor_engine="e",torpor_rank="0"} 1.0' in body
    assert b"# EOF" not in body
    status, headers, zipped = _get(server.url + "/metrics", {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip" and "Accept-Encoding" in headers["Vary"]
    assert gzip.decompress(zipped) == body
    assert len(zipped) < len(body) / 3


def test_openmetrics_only_clients_get_openmetrics(server: Server) -> None:
    """A client that accepts OpenMetrics and not the text format gets OpenMetrics, ending in # EOF."""
    _, headers, body = _get(server.url + "/metrics", {"Accept": "application/openmetrics-text;version=1.0.0"})
    assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert body.rstrip().endswith(b"# EOF")
    _, headers, _ = _get(server.url + "/metrics", {"Accept": "application/openmetrics-text", "Accept-Encoding": "br"})
    assert "Content-Encoding" not in headers


def test_events_refuse_another_engine_or_rank(server: Server) -> None:
    """/events takes the vLLM route's engine and rank parameters; they must name this endpoint's source."""
    assert fetch(server.url + "/events?engine=e&rank=0")[0] == 200
    status, _, body = fetch(server.url + "/events?rank=1")
    assert status == 400 and "serves rank 0" in json.loads(body)["error"]
    status, _, body = fetch(server.url + "/events?engine=other")
    assert status == 400 and "serves engine 'e'" in json.loads(body)["error"]


@pytest.mark.prometheus
def test_a_real_prometheus_scrape_takes_the_fast_path(controller: SleepController, tmp_path: Any) -> None:
    """A real Prometheus (its own Accept, preferring OpenMetrics, and gzip) gets the directly rendered text format."""
    with serve(controller, 0) as server:
        seen: list[tuple[str, str]] = []
        rendered: list[int] = []
        metrics_route, render = server.routes["/metrics"], server._render
        assert render is not None

        def recording_route(handler: Any, query: str) -> None:
            seen.append((handler.headers.get("Accept", ""), handler.headers.get("Accept-Encoding", "")))
            metrics_route(handler, query)

        def counting_render() -> bytes:
            rendered.append(1)
            return render()

        server.routes["/metrics"], server._render = recording_route, counting_render
        with real_prometheus(tmp_path, server.port) as (url, proc):
            deadline = time.monotonic() + 60
            while True:
                try:
                    query = f"{url}/api/v1/query?query=up{{job=%22torpor%22}}"
                    with urllib.request.urlopen(query, timeout=5) as response:  # noqa: S310 - loopback Prometheus
                        result = json.loads(response.read())["data"]["result"]
                    if result and result[0]["value"][1] == "1":
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "prometheus.log").read_text()[
                    -2000:
                ]
                time.sleep(0.2)
    assert seen, "prometheus never scraped"
    accept, encoding = seen[0]
    assert "application/openmetrics-text" in accept  # Prometheus prefers OpenMetrics...
    assert "gzip" in encoding
    assert len(rendered) >= 1  # ...and got the fast renderer's text format


def test_a_small_max_events_still_pages_through_the_window(controller: SleepController) -> None:
    """max_events bounds one response, not the window: a client pages through every recent event with after."""
    for _ in range(20):
        controller.observe()
    with serve(controller, 0, max_events=5) as srv:
        after, seen = 0, []
        while True:
            status, headers, body = fetch(f"{srv.url}/events?after={after}")
            assert status == 200
            batch = [json.loads(line)["seq"] for line in body.splitlines()]
            assert len(batch) <= 5
            if not batch:
                break
            seen += batch
            after = batch[-1]
        assert seen == list(range(1, controller.last_seq + 1))
        assert headers["X-Torpor-Last-Seq"] == str(controller.last_seq)


# -- what a hostile local client can make the engine hold (issue 30) ------------------------------------


def _rss() -> int:
    """This process's resident memory in bytes (the endpoint runs in it, as in an engine)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _handler_threads() -> int:
    """Threads the endpoint runs a connection on."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def _ready(socks: list[socket.socket], events: int, seconds: float) -> list[socket.socket]:
    """The sockets ready for ``events`` within ``seconds`` (poll: a test process holds more than FD_SETSIZE fds)."""
    poller, by_fd = select.poll(), {sock.fileno(): sock for sock in socks}
    for fd in by_fd:
        poller.register(fd, events)
    return [by_fd[fd] for fd, _ in poller.poll(seconds * 1000)]


def _push(socks: list[socket.socket], payload: bytes, seconds: float) -> None:
    """Write ``payload`` to every socket without blocking, for up to ``seconds``; sockets the server shut are dropped."""
    view, sent = memoryview(payload), dict.fromkeys(socks, 0)
    for sock in socks:
        sock.setblocking(False)
    deadline = time.monotonic() + seconds
    while sent and time.monotonic() < deadline:
        for sock in _ready(list(sent), select.POLLOUT, 0.2):
            try:
                sent[sock] += sock.send(view[sent[sock] : sent[sock] + 65536])
            except OSError:  # 431, evicted or closed: the server let go of it
                del sent[sock]
                continue
            if sent[sock] >= len(payload):
                del sent[sock]


def _raw(server: Server, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                out += chunk
        return out


def test_stalled_requests_with_huge_headers_cost_the_engine_little_memory(controller: SleepController) -> None:
    """100 connections each sending 20 x 64 KiB header lines and never finishing grow the process by < 40 MB (they grew it by ~130 MB)."""
    line = b"X-Pad: " + b"a" * (64 * 1024 - 9) + b"\r\n"
    payload = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + line * 20  # no blank line: the request never ends
    with serve(controller, 0) as srv:
        socks = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(100)]
        try:
            gc.collect()
            before = _rss()
            _push(socks, payload, seconds=15)
            time.sleep(0.5)
            grown = _rss() - before
            threads = _handler_threads()
            status, _, _ = fetch(srv.url + "/state")
        finally:
            for sock in socks:
                sock.close()
    assert grown < 40 * 2**20, f"the endpoint grew the process by {grown / 2**20:.0f} MB"
    assert threads <= 65 and status == 200


def _connect_many(port: int, n: int) -> list[socket.socket]:
    """``n`` connections opened at once (non-blocking connects: the listen backlog does not serialize them)."""
    socks = [socket.socket() for _ in range(n)]
    for sock in socks:
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
    deadline, pending = time.monotonic() + 15, list(socks)
    while pending and time.monotonic() < deadline:
        done = _ready(pending, select.POLLOUT, 0.5)
        pending = [sock for sock in pending if sock not in done]
    return socks


def test_slow_connections_are_capped_and_make_room_for_a_scrape(controller: SleepController) -> None:
    """150 connections trickling a byte each half second hold at most max_connections (64) threads; a scrape still gets in."""
    with serve(controller, 0) as srv:
        socks = _connect_many(srv.port, 150)
        alive, threads, deadline = set(socks), 0, time.monotonic() + 25
        try:  # until the server has taken every connection (a thread each) or let go of the rest
            while time.monotonic() < deadline and threads <= 65 and threads + len(socks) - len(alive) < 150:
                for sock in list(alive):
                    try:
                        sock.send(b"G")
                        gone = bool(_ready([sock], select.POLLIN, 0)) and not sock.recv(4096)
                    except OSError:
                        gone = True
                    if gone:
                        alive.discard(sock)
                threads = max(threads, _handler_threads())
                time.sleep(0.5)
            status, _, body = fetch(srv.url + "/state")
        finally:
            for sock in socks:
                sock.close()
    assert threads <= 65, f"{threads} connection threads"
    assert status == 200 and json.loads(body)["state"] == "awake"


def test_a_client_trickling_its_request_is_cut_off_at_the_read_timeout(controller: SleepController) -> None:
    """Slowloris: a head sent a byte every 0.2 s is answered 408 and closed once read_timeout (1 s) has passed."""
    with serve(controller, 0, read_timeout=1.0) as srv, socket.create_connection(("127.0.0.1", srv.port), 10) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /state HTTP/1.1\r\n")
        got = b""
        with contextlib.suppress(OSError):
            for byte in b"X-Slow: " + b"z" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.2)
                if _ready([sock], select.POLLIN, 0):
                    break
            while chunk := sock.recv(65536):
                got += chunk
        took = time.monotonic() - start
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert took < 3.0


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /state HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(70)) + b"\r\n", b"431"),
        (b"GET /state HTTP/1.1\r\n" + b"X-Big: " + b"b" * 20_000 + b"\r\n\r\n", b"431"),
        (b"GET /state?" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", b"414"),
    ],
    ids=["70 headers", "a 20 KB header", "a 9 KB request line"],
)
def test_oversized_request_heads_are_refused(server: Server, head: bytes, status: bytes) -> None:
    """More than 64 headers or 16 KiB of head gets 431, a request line over 8 KiB 414; the connection is closed."""
    got = _raw(server, head)
    assert got.startswith(b"HTTP/1.1 " + status), got[:200]
    assert b"Connection: close" in got


class _Blocking:
    """A collector whose collect() waits until released: a request that holds its connection."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def collect(self) -> Iterator[Any]:
        self.entered.release()
        self.release.wait(10)
        yield from ()


def test_a_full_endpoint_answers_503_with_retry_after(controller: SleepController) -> None:
    """With every connection busy in a request, the next one gets 503, Retry-After and Connection: close at once."""
    registry, blocking = CollectorRegistry(), _Blocking()
    registry.register(blocking)  # type: ignore[arg-type]
    with serve(controller, 0, registry=registry, max_connections=2, max_waiters=1) as srv:
        busy = [threading.Thread(target=fetch, args=(srv.url + "/metrics",)) for _ in range(2)]
        for thread in busy:
            thread.start()
        for _ in busy:
            assert blocking.entered.acquire(timeout=10)
        start = time.monotonic()
        status, headers, body = fetch(srv.url + "/state")
        took = time.monotonic() - start
        blocking.release.set()
        for thread in busy:
            thread.join(10)
        # a client has its answer before the server's thread gives the connection back: wait for that, not a 503
        deadline = time.monotonic() + 10
        while srv.admission.active and time.monotonic() < deadline:
            time.sleep(0.01)
        after = fetch(srv.url + "/state")[0]
    assert status == 503 and headers["Retry-After"] == "1" and headers["Connection"] == "close"
    assert "busy" in json.loads(body)["error"] and took < 2.0
    assert after == 200


def test_long_polls_cannot_take_every_connection(controller: SleepController) -> None:
    """40 sockets holding /events?wait=30: 32 wait, 8 get 503 with Retry-After, and /metrics and /state still answer."""
    url = f"/events?after={controller.last_seq}&wait=30"
    with serve(controller, 0) as srv:
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(40)]
        try:
            for sock in socks:
                sock.sendall(f"GET {url} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            wait_for_waiters(srv, 32)
            time.sleep(0.3)
            refused = []
            for sock in socks:
                if _ready([sock], select.POLLIN, 0):
                    refused.append(sock.recv(65536))
            scrape, state = fetch(srv.url + "/metrics")[0], fetch(srv.url + "/state")[0]
        finally:
            for sock in socks:
                sock.close()
    assert len(refused) == 8 and all(r.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in r for r in refused)
    assert scrape == 200 and state == 200


def test_long_poll_slots_must_leave_connections_for_other_requests(controller: SleepController) -> None:
    """max_waiters must stay below max_connections (else long-polls could hold every connection): a ValueError says so."""
    with pytest.raises(ValueError, match="max_waiters"):
        serve(controller, 0, max_connections=8, max_waiters=8)


def test_pipelined_requests_on_one_connection_are_each_answered(server: Server) -> None:
    """Two requests sent at once on one keep-alive connection get two answers, in order (the head reader keeps the rest)."""
    two = b"GET /state HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    got = _raw(server, two)
    assert got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 404" in got


#: Run in another process: ``n`` connections with a tiny receive buffer pipeline /events and never read, renewed.
_SLOW_READERS = r"""
import socket, sys, time
port, n, renew = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
request = b"GET /events?after=0 HTTP/1.1\r\nHost: x\r\n\r\n" * 400
socks = []
def connect():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    try:
        s.send(request)
    except OSError:
        pass
    return s
print("ready", flush=True)
while True:
    for s in socks:
        s.close()
    socks = []
    for _ in range(n):
        try:
            socks.append(connect())
        except OSError:
            pass
    time.sleep(renew)
"""


def test_slow_readers_in_another_process_do_not_deny_scrapes(controller: SleepController) -> None:
    """70 connections from another process that pipeline /events and never read: /metrics scrapes are still answered."""
    for _ in range(50):  # responses large enough to fill a socket's send buffer
        controller.observe()
    with serve(controller, 0) as srv:
        attacker = subprocess.Popen(
            [sys.executable, "-c", _SLOW_READERS, str(srv.port), "70", "10"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert attacker.stdout is not None
            assert attacker.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 20
            while srv.admission.active < srv.admission.max_connections:  # every connection held by the attack
                assert time.monotonic() < deadline, f"the attack holds only {srv.admission.active} connections"
                time.sleep(0.05)
            time.sleep(1.0)  # the attack's writes are blocked by now
            answered = 0
            scrapes = 20
            for _ in range(scrapes):
                with contextlib.suppress(OSError):
                    status, _, _ = fetch(srv.url + "/metrics")
                    answered += status == 200
                time.sleep(0.1)
        finally:
            attacker.kill()
            attacker.wait()
    assert answered >= 0.9 * scrapes, f"{answered} of {scrapes} scrapes answered under the slow-reader attack"
