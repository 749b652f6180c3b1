"""torpor.client against real running endpoints: the standalone server and vLLM's plugin routes under uvicorn."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import pytest

from torpor.client import Client
from torpor.errors import EndpointError, StateTimeout
from torpor.statemachine import SleepController
from torpor.telemetry import Server, serve
from torpor.testing import FakeMemory


def test_importing_the_client_imports_no_torch() -> None:
    """An RL controller's process gets the client without torch (or prometheus, or fastapi)."""
    code = "import sys, torpor.client; print(sorted(m for m in ('torch','prometheus_client','fastapi') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.fixture
def standalone() -> Iterator[tuple[SleepController, Server]]:
    """A controller served by the standalone endpoint."""
    controller = SleepController(FakeMemory({"weights": 1 << 20, "kv_cache": 1 << 19}), engine="e", rank=0)
    with serve(controller) as server:
        yield controller, server


def _when_waiting(server: Server, action: object) -> threading.Thread:
    """Run ``action`` in a thread once a long-poll waits on ``server``."""

    def run() -> None:
        deadline = time.monotonic() + 10
        while server.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        action()  # type: ignore[operator]

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_wait_for_returns_when_the_rank_gets_there(standalone: tuple[SleepController, Server]) -> None:
    """wait_for('asleep_l1') long-polls and returns the status once the controller is asleep."""
    controller, server = standalone
    client = Client(server.url)
    assert client.state() == "awake"
    thread = _when_waiting(server, lambda: controller.sleep(1))
    status = client.wait_for("asleep", timeout=20)
    thread.join()
    assert status["state"] == "asleep_l1"
    assert client.prefix == ""


def test_follow_yields_every_event_in_order(standalone: tuple[SleepController, Server]) -> None:
    """follow() yields the events after ``after`` as they happen, in order, then stops when idle."""
    controller, server = standalone
    client = Client(server.url, rank=0, engine="e")
    start = controller.last_seq
    controller.sleep(1)
    controller.wake()
    seen = [e.seq for e in client.follow(after=start, poll=0.5, idle_timeout=0.5)]
    assert seen == list(range(start + 1, controller.last_seq + 1))
    assert client.last_seq == controller.last_seq


def test_errors_name_the_status_and_reason(standalone: tuple[SleepController, Server]) -> None:
    """A refused request is an EndpointError with status and reason; a state never reached a StateTimeout."""
    _, server = standalone
    with pytest.raises(EndpointError, match=r"400.*rank 3") as caught:
        Client(server.url, rank=3).events()
    assert caught.value.status == 400
    with pytest.raises(StateTimeout, match=r"'asleep_l2'.*'awake'"):
        Client(server.url).wait_for("asleep_l2", timeout=0.3)
    with pytest.raises(ValueError, match="unknown state"):
        Client(server.url).wait_for("dozing")
    with pytest.raises(EndpointError, match="cannot reach"):
        Client("http://127.0.0.1:9", timeout=2).state()


def test_a_rank_the_standalone_endpoint_does_not_serve_is_refused_by_state_too(
    standalone: tuple[SleepController, Server],
) -> None:
    """Client(url, rank=3).state() and wait_for() refuse like .events() does, instead of answering for rank 0."""
    _, server = standalone
    with pytest.raises(EndpointError, match="serves rank 0, not rank 3"):
        Client(server.url, rank=3).state()
    with pytest.raises(EndpointError, match="serves rank 0, not rank 3"):
        Client(server.url, rank=3).wait_for("awake", timeout=1)
    with pytest.raises(EndpointError, match="serves engine 'e', not 'other'"):
        Client(server.url, engine="other").status()
    assert Client(server.url, rank=0, engine="e").state() == "awake"


def test_wait_for_closed_returns_once_the_engine_closed_its_log(standalone: tuple[SleepController, Server]) -> None:
    """wait_for('closed') is accepted (as `torpor status --wait closed` is) and returns once the controller closed."""
    controller, server = standalone
    client = Client(server.url)
    thread = _when_waiting(server, controller.close)
    status = client.wait_for("closed", timeout=20)
    thread.join()
    assert status["state"] == "closed" and status["closed"] is True and client.state() == "closed"


class _Busy:
    """A tiny HTTP server answering 503 + Retry-After ``busy`` times, then the ``/state`` of a rank."""

    def __init__(self, busy: int, retry_after: str | None = "0.05") -> None:
        import http.server

        outer = self
        self.busy, self.requests = busy, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # the standard library names it
                outer.requests += 1
                if outer.requests <= outer.busy:
                    body = b'{"error": "too many /events requests are waiting; retry later"}'
                    self.send_response(503)
                    if retry_after is not None:
                        self.send_header("Retry-After", retry_after)
                else:
                    body = b'{"state": "awake", "rank": 0, "engine": "e", "last_seq": 1}'
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_busy_endpoint_is_ridden_out_as_its_retry_after_says() -> None:
    """Three 503s with Retry-After, then an answer: the client waits and asks again, and gets the state."""
    busy = _Busy(3)
    try:
        assert Client(busy.url, prefix="").state() == "awake"
        assert busy.requests == 4
    finally:
        busy.close()


def test_a_busy_endpoint_past_busy_timeout_or_without_retry_after_raises() -> None:
    """Retries are bounded by busy_timeout; a 503 without Retry-After (stuck, not busy) raises at once."""
    busy = _Busy(10**6)
    try:
        start = time.monotonic()
        with pytest.raises(EndpointError, match=r"503.*still busy after 0.3 s") as caught:
            Client(busy.url, prefix="", busy_timeout=0.3).state()
        assert caught.value.status == 503 and time.monotonic() - start < 5
    finally:
        busy.close()
    plain = _Busy(1, retry_after=None)
    try:
        with pytest.raises(EndpointError, match="503"):
            Client(plain.url, prefix="").state()
        assert plain.requests == 1
    finally:
        plain.close()


def test_follow_goes_on_with_a_log_started_anew(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A log that restarts at #1 (a new engine): follow(after=old last) says so and yields the new log's events."""
    log = tmp_path / "e.rank0.jsonl"
    old = SleepController(FakeMemory({"weights": 1 << 20}), log=log, engine="e")
    for _ in range(3):
        old.sleep(1)
        old.wake()
    old.close()
    after = old.last_seq
    with serve(log) as server:
        client = Client(server.url)
        log.unlink()
        new = SleepController(FakeMemory({"weights": 1 << 20}), log=log, engine="e")
        new.sleep(1)
        with caplog.at_level("WARNING", logger="torpor.client"):
            got = list(client.follow(after=after, poll=0.5, idle_timeout=3))
        new.close()
    assert [e.seq for e in got][:3] == [1, 2, 3] and got[0].kind.value == "opened"
    assert client.restarts == 1 and "started anew" in caplog.text


vllm = pytest.importorskip("vllm")


class _Engine:
    """The engine client vLLM's /sleep and /wake_up call: every rank, as vLLM's executor does."""

    def __init__(self, ranks: list[SleepController]) -> None:
        self.ranks = ranks

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        for rank in self.ranks:
            await asyncio.to_thread(rank.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        for rank in self.ranks:
            await asyncio.to_thread(rank.wake, tags)
        return all(r.state.value == "awake" for r in self.ranks)

    async def is_sleeping(self) -> bool:
        return any(r.state.value != "awake" for r in self.ranks)


@pytest.fixture
def vllm_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[list[SleepController], str]]:
    """Two ranks logging into a directory, and a real uvicorn server with vLLM's plugin routes over it."""
    import uvicorn
    from fastapi import FastAPI
    from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins, init_endpoint_plugins_state

    monkeypatch.setenv("VLLM_PLUGINS", "torpor")
    monkeypatch.setenv("TORPOR_LOG_DIR", str(tmp_path))
    ranks = [
        SleepController(FakeMemory({"weights": 1 << 20, "kv_cache": 1 << 19}), log=tmp_path, engine="vllm", rank=r)
        for r in range(2)
    ]
    from vllm.entrypoints.serve.dev.sleep.api_router import attach_router

    app = FastAPI()
    attach_router(app)  # vLLM's own POST /sleep and /wake_up (VLLM_SERVER_DEV_MODE)
    app.state.engine_client = _Engine(ranks)
    attach_endpoint_plugins(app, ("generate",))
    asyncio.run(init_endpoint_plugins_state(None, app.state, Namespace()))
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn never started"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield ranks, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_the_client_drives_through_vllms_routes(vllm_server: tuple[list[SleepController], str]) -> None:
    """Against vLLM's API server the client finds /torpor, waits for a rank's state and follows its events."""
    ranks, url = vllm_server
    client = Client(url, rank=1)
    assert client.state() == "awake"
    start = client.last_seq
    timer = threading.Timer(0.3, lambda: [r.sleep(1) for r in ranks])
    timer.start()
    status = client.wait_for("asleep_l1", timeout=20)
    timer.join()
    assert client.prefix == "/torpor"
    assert status["rank"] == 1 and status["state"] == "asleep_l1"
    kinds = [e.kind.value for e in client.events(after=start)]
    assert kinds[0] == "sleep_requested" and kinds[-1] == "sleep_completed"
    assert all(e.rank == 1 for e in client.events(after=0))


def test_the_rl_loop_example_runs_against_vllms_routes(vllm_server: tuple[list[SleepController], str]) -> None:
    """examples/rl_loop.py drives vLLM's /sleep and /wake_up and confirms every rank through the client."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rl_loop", Path(__file__).parents[1] / "examples" / "rl_loop.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    ranks, url = vllm_server
    trained: list[tuple[int, list[str]]] = []

    def train(step: int) -> None:
        trained.append((step, [r.state.value for r in ranks]))  # the GPU is the trainer's: every rank asleep

    report = example.rl_loop(url, 2, train, ranks=2, timeout=30)
    assert trained == [(0, ["asleep_l1", "asleep_l1"]), (1, ["asleep_l1", "asleep_l1"])]
    assert [r.state.value for r in ranks] == ["awake", "awake"]
    assert len(report) == 2
    assert {"rank0_sleep_s", "rank1_sleep_s", "rank0_wake_weights_s", "rank1_wake_kv_cache_s"} <= set(report[1])


def test_the_rl_loop_example_says_in_one_line_when_the_endpoint_refuses_it() -> None:
    """examples/rl_loop.py against a port nobody serves: exit 1 and one line naming the URL, no traceback."""
    import socket

    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(__file__).parents[1] / "examples" / "rl_loop.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--url", f"http://127.0.0.1:{port}", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(err) == 1 and f"127.0.0.1:{port}" in err[0] and "Traceback" not in proc.stderr, err


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, "5"])
def test_wait_for_refuses_a_timeout_that_never_passes_before_asking(timeout: object) -> None:
    """wait_for(timeout=nan) never returned: nan, inf, a negative or a non-number is a ValueError at once, before any request."""
    client = Client("http://127.0.0.1:9")  # nothing listens: a request would fail otherwise
    with pytest.raises(ValueError, match=r"timeout=.* is refused: give a finite number of seconds >= 0"):
        client.wait_for("awake", timeout=timeout)  # type: ignore[arg-type]
