"""The /torpor/state and /torpor/events routes, loaded by vLLM's endpoint-plugin machinery, on a real ASGI client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from torpor.statemachine import SleepController  # noqa: E402
from torpor.testing import FakeMemory  # noqa: E402


def ndjson(body: bytes) -> list[dict[str, Any]]:
    """The events of an NDJSON body."""
    return [json.loads(line) for line in body.splitlines()]


def vllm_app(
    monkeypatch: pytest.MonkeyPatch, log_dir: Path, plugins: str | None = "torpor", lifespan: Any = None
) -> FastAPI:
    """A FastAPI app wired the way vLLM's build_app/init_app_state wire endpoint plugins."""
    from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins, init_endpoint_plugins_state

    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    monkeypatch.setenv("TORPOR_LOG_DIR", str(log_dir))
    app = FastAPI(lifespan=lifespan)
    attach_endpoint_plugins(app, ("generate",))
    asyncio.run(init_endpoint_plugins_state(None, app.state, Namespace()))
    return app


def ranks(log_dir: Path, n: int = 2) -> list[SleepController]:
    """``n`` ranks of engine ``vllm`` logging into ``log_dir``."""
    return [
        SleepController(FakeMemory({"weights": 1 << 20, "kv_cache": 1 << 19}), log=log_dir, engine="vllm", rank=r)
        for r in range(n)
    ]


def test_routes_answer_when_allowlisted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """VLLM_PLUGINS=torpor: /torpor/state merges the ranks' logs, /torpor/events returns a rank's events after SEQ."""
    controllers = ranks(tmp_path)
    for c in controllers:
        c.sleep(1)
    client = TestClient(vllm_app(monkeypatch, tmp_path))
    state = client.get("/torpor/state")
    assert state.status_code == 200
    body = state.json()
    assert body["state"] == "asleep"
    assert [r["rank"] for r in body["engines"][0]["ranks"]] == [0, 1]
    controllers[1].wake(["weights"])
    state = client.get("/torpor/state").json()
    assert state["engines"][0]["state"] == "transitional"
    response = client.get("/torpor/events", params={"rank": 1, "after": 2})
    assert response.headers["content-type"] == "application/x-ndjson"
    events = ndjson(response.content)
    seqs = [e["seq"] for e in events]
    assert seqs[0] == 3
    assert seqs == sorted(seqs)
    assert events[-1]["kind"] == "wake_completed"
    assert response.headers["X-Torpor-Last-Seq"] == str(seqs[-1])
    assert response.headers["X-Torpor-Rank"] == "1"
    limited = client.get("/torpor/events", params={"rank": 1, "limit": 2})
    assert [e["seq"] for e in ndjson(limited.content)] == [1, 2]


def test_events_long_poll_waits_for_the_next_event(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """wait=S holds the request until a new event appears (or S passes), for RL controllers."""
    (controller,) = ranks(tmp_path, 1)
    client = TestClient(vllm_app(monkeypatch, tmp_path))
    last = controller.last_seq
    start = time.monotonic()
    empty = client.get("/torpor/events", params={"after": last, "wait": 0.5})
    assert empty.status_code == 200 and empty.content == b""
    assert time.monotonic() - start >= 0.45

    import threading

    timer = threading.Timer(0.3, lambda: controller.sleep(1))
    timer.start()
    got = ndjson(client.get("/torpor/events", params={"after": last, "wait": 10}).content)
    timer.join()
    assert got[0]["kind"] == "sleep_requested"


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"rank": "x"}, "rank must be a non-negative integer"),
        ({"after": -1}, "after must be a non-negative integer"),
        ({"wait": 99}, "wait must be between"),
        ({"limit": 0}, "limit must be between"),
        ({"bogus": 1}, "unknown query parameter"),
    ],
)
def test_bad_parameters_get_400(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, params: dict[str, Any], reason: str
) -> None:
    """A bad query parameter is a 400 that names it."""
    ranks(tmp_path, 1)
    client = TestClient(vllm_app(monkeypatch, tmp_path))
    response = client.get("/torpor/events", params=params)
    assert response.status_code == 400
    assert reason in response.json()["error"]


def test_missing_logs_get_404(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No logs in the directory, or no such rank: 404 with the reason."""
    client = TestClient(vllm_app(monkeypatch, tmp_path))
    assert client.get("/torpor/state").status_code == 404
    ranks(tmp_path, 1)
    response = client.get("/torpor/events", params={"rank": 5})
    assert response.status_code == 404
    assert "no log for rank 5" in response.json()["error"]


def test_routes_absent_without_allowlist(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Endpoint plugins are opt-in: without VLLM_PLUGINS vLLM does not load torpor's routes."""
    ranks(tmp_path, 1)
    client = TestClient(vllm_app(monkeypatch, tmp_path, plugins=None))
    assert client.get("/torpor/state").status_code == 404
    assert "error" not in client.get("/torpor/state").json()


def test_routes_are_read_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """POST to the routes is not allowed: they change nothing."""
    ranks(tmp_path, 1)
    client = TestClient(vllm_app(monkeypatch, tmp_path))
    assert client.post("/torpor/state").status_code == 405
    assert client.post("/torpor/events").status_code == 405


def count_decoded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one for every log line decoded from now on (counted at the codec's fast check)."""
    import torpor.statemachine.log.codec as codec_module

    decoded: list[int] = []
    check = codec_module._payload_ok

    def counting(data: Any, required: Any, rules: Any) -> bool:
        decoded.append(1)
        return check(data, required, rules)

    monkeypatch.setattr(codec_module, "_payload_ok", counting)
    return decoded


def test_long_polls_do_not_reparse_the_log(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A waiting /torpor/events reads only what is appended (the follower of `torpor log follow`), never the whole log."""
    (controller,) = ranks(tmp_path, 1)
    for _ in range(200):
        controller.observe()
    client = TestClient(vllm_app(monkeypatch, tmp_path))
    assert len(ndjson(client.get("/torpor/events").content)) == controller.last_seq  # the tail starts: one read
    decoded = count_decoded(monkeypatch)
    start = time.monotonic()
    empty = client.get("/torpor/events", params={"after": controller.last_seq, "wait": 1.0})
    assert empty.content == b"" and time.monotonic() - start >= 0.9
    assert len(decoded) == 0, f"{len(decoded)} lines decoded while nothing was appended"
    controller.observe()
    got = ndjson(client.get("/torpor/events", params={"after": controller.last_seq - 1}).content)
    assert [e["seq"] for e in got] == [controller.last_seq]
    assert len(decoded) == 1


def test_state_reads_only_what_was_appended(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """/torpor/state decodes only the lines appended since the last request, not every rank's log again."""
    controllers = ranks(tmp_path, 2)
    for _ in range(100):
        controllers[0].observe()
    client = TestClient(vllm_app(monkeypatch, tmp_path))
    assert client.get("/torpor/state").json()["state"] == "awake"  # the first request reads each log once
    decoded = count_decoded(monkeypatch)
    assert client.get("/torpor/state").json()["state"] == "awake"
    assert decoded == []
    for c in controllers:
        c.sleep(1)
    appended = sum(c.last_seq for c in controllers) - 100 - 2  # what the sleeps wrote after the opening events
    body = client.get("/torpor/state").json()
    assert body["state"] == "asleep"
    assert [r["last_seq"] for r in body["engines"][0]["ranks"]] == [c.last_seq for c in controllers]
    assert len(decoded) == appended


def test_state_names_a_bad_line_and_heals_when_it_is_repaired(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A rank log that grows a bad line is unreadable (naming file and line) until the line is repaired in place."""
    from support import raw_event

    from torpor.statemachine.core.events import EventKind
    from torpor.statemachine.log.reader import encode_line

    (controller,) = ranks(tmp_path, 1)
    client = TestClient(vllm_app(monkeypatch, tmp_path))
    assert client.get("/torpor/state").json()["state"] == "awake"
    path = controller.log.path  # type: ignore[union-attr]
    good = path.read_bytes()
    lines = good.count(b"\n")
    controller.log.close()  # type: ignore[union-attr]
    path.write_bytes(good + b'{"crc":"00000000","schema":1}\n')
    rank = client.get("/torpor/state").json()["engines"][0]["ranks"][0]
    assert rank["state"] == "unreadable" and f"{path}:{lines + 1}:" in rank["error"]
    repaired = raw_event(EventKind.USAGE_OBSERVED, lines + 1, "vllm", 0, {"usage": {"weights": 1}})
    path.write_bytes(good + encode_line(repaired))  # the bad line repaired in place
    rank = client.get("/torpor/state").json()["engines"][0]["ranks"][0]
    assert rank["state"] == "awake" and rank["last_seq"] == lines + 1


def test_waiters_are_bounded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Beyond MAX_WAITERS waiting long-polls a new one gets 503 with Retry-After; a plain read still answers."""
    from torpor.hooks.vllm import endpoint as route

    (controller,) = ranks(tmp_path, 1)
    monkeypatch.setattr(route, "MAX_WAITERS", 2)
    app = vllm_app(monkeypatch, tmp_path)
    client = TestClient(app)
    results: list[int] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                client.get("/torpor/events", params={"after": controller.last_seq, "wait": 20}).status_code
            )
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    plugin = next(p for p in _plugins(app))
    deadline = time.monotonic() + 10
    while plugin.waiting < 2:
        assert time.monotonic() < deadline, "the long-polls never waited"
        time.sleep(0.01)
    refused = client.get("/torpor/events", params={"after": controller.last_seq, "wait": 5})
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert client.get("/torpor/events").status_code == 200
    controller.observe()
    for t in threads:
        t.join(timeout=10)
    assert results == [200, 200]
    assert plugin.waiting == 0


def _plugins(app: FastAPI) -> list[Any]:
    """The endpoint plugins vLLM attached to ``app``."""
    return list(app.state.endpoint_plugins)


def test_hung_up_long_polls_leave_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Under a real server (uvicorn), a /torpor/events long-poll whose client hangs up frees its place at once."""
    import socket

    import uvicorn

    (controller,) = ranks(tmp_path, 1)
    app = vllm_app(monkeypatch, tmp_path)
    plugin = _plugins(app)[0]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn never started"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        target = f"/torpor/events?after={controller.last_seq}&wait=30"
        socks = []
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            socks.append(sock)
        deadline = time.monotonic() + 10
        while plugin.waiting < 3:
            assert time.monotonic() < deadline, "the long-polls never waited"
            time.sleep(0.01)
        for sock in socks:
            sock.close()
        deadline = time.monotonic() + 3
        while plugin.waiting:
            assert time.monotonic() < deadline, "hung-up long-polls still wait"
            time.sleep(0.01)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def tail_threads() -> list[threading.Thread]:
    """The rank-log tail threads alive."""
    return [t for t in threading.enumerate() if t.name.startswith("torpor-log-source:")]


def test_the_servers_shutdown_stops_every_rank_log_tail(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An API server with its own lifespan (as vLLM's build_app makes it) that shuts down stops the plugin's tails."""
    import contextlib

    ran: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        ran.append("startup")
        yield
        ran.append("shutdown")

    (controller,) = ranks(tmp_path, 1)
    controller.sleep(1)
    app = vllm_app(monkeypatch, tmp_path, lifespan=lifespan)
    before = set(tail_threads())  # other tests' servers never shut down
    with TestClient(app) as client:
        assert client.get("/torpor/events").status_code == 200
        assert client.get("/torpor/state").status_code == 200
        mine = set(tail_threads()) - before
        assert mine
    assert ran == ["startup", "shutdown"]
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in mine):
        assert time.monotonic() < deadline, "a rank log's tail outlived the server"
        time.sleep(0.01)
