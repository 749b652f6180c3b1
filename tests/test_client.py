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
