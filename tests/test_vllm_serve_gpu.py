"""``vllm serve`` with the torpor backend on a GPU, over HTTP: sleep, staged wake, metrics, torpor's routes, the RL example.

Each test starts one server (torch.compile + CUDA graphs, graphs in torpor's
pool, ``VLLM_PLUGINS=torpor``, ``VLLM_SERVER_DEV_MODE=1`` for /sleep and
/wake_up, a fresh ``PROMETHEUS_MULTIPROC_DIR``) and makes all its checks on
it, because each start costs about a minute. The second test runs vLLM's
async scheduler with requests in flight when /sleep arrives.

What vLLM 0.33 promises for requests during a sleep (``/sleep?mode=``, the
engine core's ``pause_scheduler``): ``abort`` (the default) ends the requests
in flight as aborted before the memory goes; ``wait`` lets them finish first;
requests that arrive while asleep are queued and run after the full wake
(the scheduler resumes only when every tag is back). torpor's part is to
refuse or wait, never corrupt: no sleep starts under a running step, and what
runs after the wake computes exactly what it computed before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import vllm_gpu_support as support
from support import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]  # an engine start with torch.compile takes a minute or more

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 420.0


class Server:
    """A running ``vllm serve`` and the calls the tests make on it."""

    def __init__(self, url: str, model: Path, log_dir: Path, engine: str) -> None:
        self.url, self.model, self.log_dir, self.engine = url, model, log_dir, engine
        self.proc: subprocess.Popen[bytes] | None = None  # the server's process (the leader of its group)
        self.log_path: Path | None = None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 300) -> tuple[int, str]:
        """One HTTP request; (status, body text), errors included."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data else {}
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
                return response.status, response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode("utf-8", "replace")

    def ok(self, method: str, path: str, timeout: float = 300) -> Any:
        """A request that must answer 200; its JSON (or None when the body is not JSON)."""
        code, text = self.call(method, path, timeout=timeout)
        assert code == 200, f"{method} {path}: HTTP {code} {text[:300]}"
        try:
            return json.loads(text)
        except ValueError:
            return None

    def complete(self, prompt: str, max_tokens: int = 16) -> dict[str, Any]:
        """A greedy completion's first choice (text, finish_reason), or {"http": code, "error": body}."""
        body = {
            "model": str(self.model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        code, text = self.call("POST", "/v1/completions", body, timeout=600)
        if code != 200:
            return {"http": code, "error": text[:300]}
        choice: dict[str, Any] = json.loads(text)["choices"][0]
        return {"http": 200, "text": choice["text"], "finish_reason": choice.get("finish_reason")}

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Every sample on /metrics."""
        code, text = self.call("GET", "/metrics", timeout=60)
        assert code == 200, f"/metrics: HTTP {code}"
        return support.samples(text)

    def torpor_state(self) -> dict[str, Any]:
        """/torpor/state: the engine-wide view (the first engine there)."""
        view = self.ok("GET", "/torpor/state")
        engines = view["engines"] if isinstance(view, dict) and "engines" in view else [view]
        found: dict[str, Any] = next(e for e in engines if e.get("engine") == self.engine)
        return found

    def events(self, after: int, wait: float | None = None) -> list[dict[str, Any]]:
        """/torpor/events of rank 0 after ``after`` (NDJSON), long-polling ``wait`` seconds when given."""
        path = f"/torpor/events?rank=0&engine={self.engine}&after={after}" + (f"&wait={wait}" if wait else "")
        code, text = self.call("GET", path, timeout=(wait or 0) + 60)
        assert code == 200, f"{path}: HTTP {code} {text[:300]}"
        return [json.loads(line) for line in text.splitlines() if line.strip()]


@contextmanager
def serve(tmp_path: Path, engine: str, *extra: str, metrics_dir: bool = True) -> Iterator[Server]:
    """``vllm serve`` with torpor, up and healthy; stopped (its process group) afterwards, its log tail on failure.

    ``metrics_dir``: False starts it with no metrics variable set at all (neither
    ``PROMETHEUS_MULTIPROC_DIR`` nor ``TORPOR_METRICS_DIR``), as a new user would.
    """
    model = support.require_vllm_gpu()
    port = free_port()
    log_dir = tmp_path / "logs"
    prom = tmp_path / "prom"
    prom.mkdir()
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_PLUGINS="torpor",
        PROMETHEUS_MULTIPROC_DIR=str(prom),
        TORPOR_LOG_DIR=str(log_dir),
        TORPOR_ENGINE=engine,
        VLLM_USE_FLASHINFER_SAMPLER="0",
    )
    if not metrics_dir:
        for name in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir", "TORPOR_METRICS_DIR"):
            env.pop(name, None)
    log_path = Path(os.environ.get("OUT") or tmp_path) / f"{engine}.serve.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        support.serve_args(model, port, *extra), stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0
    )
    server = Server(f"http://127.0.0.1:{port}", model, log_dir, engine)
    server.proc, server.log_path = proc, log_path
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, f"vllm serve exited with {proc.returncode}; log {log_path}"
            assert time.monotonic() < deadline, f"no /health after {STARTUP_S} s; log {log_path}"
            try:
                if server.call("GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        yield server
    except BaseException:
        log.flush()
        print("".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:]), file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def _check_metrics(server: Server, torpor_state: str, vllm_state: str) -> list[tuple[str, dict[str, str], float]]:
    """torpor's state on /metrics is ``torpor_state``, vLLM's gauge ``vllm_state``; joined as the recording rule does."""
    rows = server.metrics()
    for family in ("torpor_state", "torpor_tag_bytes", "torpor_pinned_host_bytes", "torpor_cudagraphs"):
        assert any(n == family or n.startswith(family + "_") for n, _, _ in rows), f"no {family} on /metrics"
    torpor = support.torpor_state_with_vllm_engine(rows)
    vllm = support.vllm_sleep_state(rows)
    assert torpor == {("0", "0"): torpor_state}, torpor
    # the join on vLLM's engine label: every torpor rank finds its engine's sleep state
    joined = {key: (state, vllm.get(key[0])) for key, state in torpor.items()}
    assert joined == {("0", "0"): (torpor_state, vllm_state)}, (joined, vllm)
    return rows


def test_serve_sleep_staged_wake_metrics_routes_and_rl_example(tmp_path: Path) -> None:
    """/sleep, /wake_up?tags=, /metrics joined with vLLM's sleep gauge, /torpor/state and events?wait=, rl_loop.py."""
    with serve(tmp_path, "serve-gpu-test", "--no-async-scheduling") as server:
        first = server.complete(support.PROMPTS[0])
        assert first["http"] == 200 and first["text"], first
        rows = _check_metrics(server, "awake", "awake")
        assert support.tag_bytes(rows, "weights", "resident") > 0
        assert support.tag_bytes(rows, "kv_cache", "resident") > 0
        assert server.torpor_state()["state"] == "awake"
        mark = server.events(after=0)[-1]["seq"]

        polled: list[list[dict[str, Any]]] = []
        poll = threading.Thread(target=lambda: polled.append(server.events(after=mark, wait=30)))  # 30: the most
        poll.start()
        time.sleep(1.0)
        assert poll.is_alive(), "the long poll answered before anything happened"
        assert server.ok("POST", "/sleep?level=1") == {"status": "sleeping", "level": 1}
        poll.join(40)
        assert polled and polled[0], "the long poll did not return the sleep's events"
        since = server.events(after=mark)
        assert since[0]["kind"] == "sleep_requested", since[0]
        assert polled[0][0]["seq"] == since[0]["seq"], (polled[0][0], since[0])
        assert "sleep_completed" in [e["kind"] for e in since]
        assert server.ok("GET", "/is_sleeping") == {"is_sleeping": True}
        rows = _check_metrics(server, "asleep_l1", "weights_offloaded")
        assert support.tag_bytes(rows, "weights", "resident") == 0
        assert support.tag_bytes(rows, "weights", "host") > 0
        assert support.tag_bytes(rows, "kv_cache", "discarded") > 0
        assert support.tag_bytes(rows, "cudagraph", "host") > 0
        assert server.torpor_state()["state"] == "asleep"

        assert server.ok("POST", "/wake_up?tags=weights")["status"] == "sleeping"
        assert server.ok("GET", "/is_sleeping") == {"is_sleeping": True}
        assert server.torpor_state()["state"] == "partially_awake"
        rows = _check_metrics(server, "partially_awake", "weights_offloaded")  # vLLM: awake only when fully awake
        assert support.tag_bytes(rows, "weights", "resident") > 0
        assert support.tag_bytes(rows, "kv_cache", "resident") == 0
        assert server.ok("POST", "/wake_up?tags=kv_cache")["status"] == "awake"
        assert server.ok("GET", "/is_sleeping") == {"is_sleeping": False}
        _check_metrics(server, "awake", "awake")
        assert server.torpor_state()["state"] == "awake"
        assert server.complete(support.PROMPTS[0]) == first

        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--url", server.url, "--steps", "2"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        rounds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert len(rounds) == 2 and all("rank0_sleep_s" in r for r in rounds), done.stdout
        assert server.complete(support.PROMPTS[0]) == first
        assert support.torpor_status(server.log_dir, server.engine)["state"] == "awake"
        bad = [e for e in server.events(after=0) if e["kind"] in ("refused", "sleep_aborted", "wake_failed")]
        assert not bad, bad


def test_serve_async_scheduling_requests_in_flight_and_queued_across_sleep(tmp_path: Path) -> None:
    """Async scheduling: /sleep aborts (or with mode=wait drains) running requests; queued ones run exactly after wake."""
    prompts = support.PROMPTS
    long = 900  # tokens: each request runs for a second or more

    with serve(tmp_path, "serve-async-gpu-test", "--async-scheduling") as server:

        def batch(max_tokens: int, during: Any = None) -> list[dict[str, Any]]:
            """The four prompts queued while scheduling is paused (level 0), so they run as one batch once resumed."""
            results: list[dict[str, Any]] = [{} for _ in prompts]

            def one(i: int) -> None:
                results[i] = server.complete(prompts[i], max_tokens)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            server.ok("POST", "/sleep?level=0")
            for t in threads:
                t.start()
            time.sleep(1.5)  # every request reached the engine core and waits
            assert all(t.is_alive() for t in threads), "a request ran while scheduling was paused"
            if during is None:
                server.ok("POST", "/wake_up?tags=scheduling")
            else:
                during()
            for t in threads:
                t.join(300)
            assert not any(t.is_alive() for t in threads), "a request never finished"
            return results

        reference = batch(long)
        assert all(r["http"] == 200 and r["finish_reason"] == "length" for r in reference), reference

        # in flight, mode=abort (vLLM's default): the running requests end aborted, a prefix of the reference
        def sleep_while_running() -> None:
            server.ok("POST", "/wake_up?tags=scheduling")
            time.sleep(0.3)
            assert server.ok("POST", "/sleep?level=1") == {"status": "sleeping", "level": 1}

        aborted = batch(long, sleep_while_running)
        assert server.torpor_state()["state"] == "asleep"
        for got, want in zip(aborted, reference, strict=True):
            if got["http"] == 200:
                assert got["finish_reason"] in ("abort", "length"), got
                assert want["text"].startswith(got["text"].rstrip("\ufffd")), "an aborted request's text is corrupt"
        print(
            "requests in flight at /sleep?mode=abort:",
            json.dumps([{k: v for k, v in r.items() if k != "text"} for r in aborted]),
        )
        assert server.ok("POST", "/sleep?level=1") == {"status": "sleeping", "level": 1}  # again: vLLM's no-op

        # queued while asleep: they wait for the full wake, then compute exactly the reference
        queued: list[dict[str, Any]] = [{} for _ in prompts]
        threads = [
            threading.Thread(target=lambda i=i: queued.__setitem__(i, server.complete(prompts[i], long)))
            for i in range(len(prompts))
        ]
        for t in threads:
            t.start()
        time.sleep(1.5)
        assert all(t.is_alive() for t in threads), "a request ran while the engine was asleep"
        server.ok("POST", "/wake_up?tags=weights")
        time.sleep(0.5)
        assert all(t.is_alive() for t in threads), "a request ran while the engine was partially awake"
        assert server.ok("POST", "/wake_up?tags=kv_cache")["status"] == "awake"
        for t in threads:
            t.join(300)
        assert queued == reference, "requests queued during sleep computed something else after the wake"

        # in flight, mode=wait: the sleep waits for them; they finish exactly, then the memory goes
        states: list[str] = []

        def sleep_waiting() -> None:
            server.ok("POST", "/wake_up?tags=scheduling")
            time.sleep(0.5)
            states.append(server.torpor_state()["state"])
            server.ok("POST", "/sleep?level=1&mode=wait", timeout=600)
            states.append(server.torpor_state()["state"])

        drained = batch(long, sleep_waiting)
        assert drained == reference, "requests drained by /sleep?mode=wait computed something else"
        assert states == ["awake", "asleep"], states
        assert server.ok("POST", "/wake_up")["status"] == "awake"
        assert batch(long) == reference

        events = server.events(after=0)
        kinds = [e["kind"] for e in events]
        bad = [e for e in events if e["kind"] in ("refused", "sleep_aborted", "wake_failed")]
        assert not bad, bad
        assert kinds.count("sleep_completed") == 2, kinds


def test_serve_with_no_metrics_variable_shows_torpor_state_on_metrics(tmp_path: Path) -> None:
    """``vllm serve --enable-sleep-mode --sleep-mode-backend torpor`` with no metrics variable set shows torpor_state (and vLLM's own gauge) on /metrics, awake and asleep."""
    with serve(tmp_path, "serve-nometrics-test", "--no-async-scheduling", metrics_dir=False) as server:
        assert server.complete(support.PROMPTS[0])["http"] == 200
        _check_metrics(server, "awake", "awake")
        assert server.ok("POST", "/sleep?level=1") == {"status": "sleeping", "level": 1}
        _check_metrics(server, "asleep_l1", "weights_offloaded")
        assert server.ok("POST", "/wake_up")["status"] == "awake"
        _check_metrics(server, "awake", "awake")
