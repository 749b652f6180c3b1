"""Tests for torpor.telemetry.endpoint: /metrics, /state and /events, read-only, loopback, bounded, 400 on bad input."""

from __future__ import annotations

import json
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
from torpor.telemetry.endpoint import BadRequest, parse_query
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
    assert len(controller._subscribers) == 0
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
    from torpor.telemetry.endpoint import BadRequest, int_param

    with pytest.raises(BadRequest, match="non-negative integer"):
        int_param({"after": raw}, "after", 0, 0, 10**9)


def test_int_param_refuses_huge_numbers_before_converting() -> None:
    """A 5000-digit value is out of range (a BadRequest), not int()'s digit-limit ValueError; zeros pad fine."""
    from torpor.telemetry.endpoint import BadRequest, int_param

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
