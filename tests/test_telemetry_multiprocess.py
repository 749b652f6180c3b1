"""Tests for torpor.telemetry.multiprocess: separate worker processes write, one reader merges per rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import Samples, samples
from support import value as get

from torpor.telemetry import multiprocess_registry
from torpor.telemetry.multiprocess import enabled

WORKER = """
import sys
from torpor import SleepController
from torpor.telemetry import attach
from torpor.testing import FakeMemory

rank, script = int(sys.argv[1]), sys.argv[2]
scale = rank + 1
memory = FakeMemory({"weights": 1000 * scale, "kv_cache": 2000 * scale, "cudagraph": 30 * scale})
controller = SleepController(memory, engine="mp", rank=rank)
handle = attach(controller)
if handle.multiprocess is None or handle.collector is not None:
    sys.exit("attach did not pick multiprocess mode")
for step in script.split(","):
    if step == "sleep1":
        controller.sleep(1)
    elif step == "sleep2":
        controller.sleep(2)
    elif step == "wake_weights":
        controller.wake(["weights"])
    elif step == "wake":
        controller.wake()
    elif step == "refuse":
        try:
            controller.wake(["weights"]) if controller.state.value == "awake" else controller.sleep(1)
        except Exception:
            pass
"""


def run_worker(directory: Path, rank: int, script: str, source: str = WORKER) -> str:
    """Run ``source`` (argv: rank, script) as a separate process writing metrics to ``directory``; its stdout."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    result = subprocess.run(
        [sys.executable, "-c", source, str(rank), script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def read(directory: Path) -> Samples:
    """Merge the directory's files the way an API server's /metrics does."""
    return samples(multiprocess_registry(str(directory)))


def test_enabled_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Multiprocess mode is on exactly when PROMETHEUS_MULTIPROC_DIR is set."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    assert not enabled()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/x")
    assert enabled()


def test_per_rank_values_are_not_summed_across_processes(tmp_path: Path) -> None:
    """Two worker processes: each rank's state, bytes and counts come out as that rank wrote them."""
    run_worker(tmp_path, 0, "sleep1,refuse")
    run_worker(tmp_path, 1, "sleep2,wake_weights")
    got = read(tmp_path)
    r0, r1 = {"torpor_engine": "mp", "torpor_rank": "0"}, {"torpor_engine": "mp", "torpor_rank": "1"}
    assert get(got, "torpor_state", **r0, state="asleep_l1") == 1
    assert get(got, "torpor_state", **r0, state="awake") == 0
    assert get(got, "torpor_state", **r1, state="partially_awake") == 1
    assert get(got, "torpor_tag_bytes", **r0, tag="weights", residency="host") == 1000
    assert get(got, "torpor_tag_bytes", **r0, tag="kv_cache", residency="discarded") == 2000
    assert get(got, "torpor_tag_bytes", **r1, tag="weights", residency="resident") == 2000
    assert get(got, "torpor_tag_bytes", **r1, tag="kv_cache", residency="discarded") == 4000
    assert get(got, "torpor_transitions_total", **r0, from_state="awake", to_state="suspending") == 1
    assert get(got, "torpor_transitions_total", **r1, from_state="resuming", to_state="partially_awake") == 1
    assert get(got, "torpor_refusals_total", **r0, command="sleep", error_type="InvalidTransition") == 1
    assert get(got, "torpor_sleep_duration_seconds_count", **r1, level="2") == 1
    assert get(got, "torpor_wake_duration_seconds_count", **r1, tags="weights") == 1
    assert get(got, "torpor_info", **r0, version="0.1.0", driver="FakeMemory") == 1
    assert not [k for k in got if ("pid", str(os.getpid())) in k[1] or any(n == "pid" for n, _ in k[1])]


def test_a_restarted_rank_shows_its_latest_state_and_keeps_its_counts(tmp_path: Path) -> None:
    """A second process for the same rank overrides the gauges (most recent) and adds to the counters."""
    run_worker(tmp_path, 0, "sleep1")
    run_worker(tmp_path, 0, "sleep1")
    run_worker(tmp_path, 0, "")
    got = read(tmp_path)
    r0 = {"torpor_engine": "mp", "torpor_rank": "0"}
    assert get(got, "torpor_state", **r0, state="awake") == 1
    assert get(got, "torpor_state", **r0, state="asleep_l1") == 0
    assert get(got, "torpor_tag_bytes", **r0, tag="weights", residency="resident") == 1000
    assert get(got, "torpor_sleep_duration_seconds_count", **r0, level="1") == 2


def _shape(text: bytes) -> set[tuple[str, tuple[str, ...]]]:
    """(sample name, label names) of every sample: what a dashboard query can select on."""
    return {
        (s.name, tuple(sorted(s.labels)))
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


@pytest.mark.prometheus
def test_multiprocess_exposition_is_promtool_clean_and_shaped_like_the_collector(tmp_path: Path) -> None:
    """The merged files pass promtool and expose the same names and labels as the scrape-time collector."""
    from prometheus_client import CollectorRegistry

    from torpor import InvalidTransition, SleepController
    from torpor.telemetry import attach
    from torpor.testing import FakeMemory

    run_worker(tmp_path, 0, "sleep1,refuse,wake_weights,wake")
    merged = generate_latest(multiprocess_registry(str(tmp_path)))
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=merged, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == b""
    assert result.stderr.strip() == b""
    registry = CollectorRegistry()
    controller = SleepController(FakeMemory({"weights": 1000, "kv_cache": 2000, "cudagraph": 30}), engine="mp")
    attach(controller, registry=registry, otel=False, multiprocess=False)
    controller.sleep(1)
    with pytest.raises(InvalidTransition):
        controller.sleep(1)
    controller.wake(["weights"])
    controller.wake()
    assert _shape(merged) == _shape(generate_latest(registry))


def test_one_process_writes_each_rank_once() -> None:
    """In multiprocess mode a second controller with the same engine and rank in one process is refused until the first detaches."""
    from torpor import SleepController
    from torpor.telemetry import DuplicateRank, attach
    from torpor.testing import FakeMemory

    first = SleepController(FakeMemory({"weights": 10}), engine="mp-dup", rank=3)
    second = SleepController(FakeMemory({"weights": 10}), engine="mp-dup", rank=3)
    handle = attach(first, otel=False, multiprocess=True)
    with pytest.raises(DuplicateRank, match="multiprocess directory"):
        attach(second, otel=False, multiprocess=True)
    assert len(second._recorder.subscribers) == 0
    handle.detach()
    attach(second, otel=False, multiprocess=True).detach()


KEPT_WORKER = """
import json, sys
from torpor import SleepController
from torpor.allocator import SimDriver, TaggedAllocator
from torpor.allocator.host.offload import HostPolicy
from torpor.keeper import ModelIdentity, TensorSpec
from torpor.keeper import attach as keep
from torpor.telemetry import attach
from torpor.units import MiB

rank, sock = int(sys.argv[1]), sys.argv[2]
alloc = TaggedAllocator(SimDriver(256 * MiB), host=HostPolicy(chunk_bytes=2 * MiB))
controller = SleepController(alloc, engine="mpk", rank=rank)
handle = attach(controller, otel=False)  # first, as vLLM's wiring attaches it when the controller is made
if handle.multiprocess is None:
    sys.exit("attach did not pick multiprocess mode")
address = alloc.allocate(3 * MiB, tag="weights")
alloc.write(address, bytes(3 * MiB))
backing = keep(alloc, controller, keeper=sock, engine=f"mpk-rank{rank}")  # after load, as the keeper's loader does
backing.track(ModelIdentity.of("m", [TensorSpec("w", (3 * MiB,), "uint8", 3 * MiB)]), {"w": address})
controller.sleep(1)
print(json.dumps({"kept": backing.kept_bytes, "published": backing.published_bytes}))
"""


def test_keeper_bytes_cross_to_the_serving_process(tmp_path: Path) -> None:
    """Two worker processes with a keeper backing: the merged files show each rank's keeper bytes, published backup and up."""
    from keeper_engine import running_keeper

    sock = tmp_path / "k" / "keeper.sock"
    (tmp_path / "metrics").mkdir()
    with running_keeper(sock):
        written = {}
        for rank in (0, 1):
            out = run_worker(tmp_path / "metrics", rank, str(sock), source=KEPT_WORKER)
            written[rank] = json.loads(out.strip().splitlines()[-1])
    got = read(tmp_path / "metrics")
    for rank in (0, 1):
        labels = {"torpor_engine": "mpk", "torpor_rank": str(rank), "keeper_engine": f"mpk-rank{rank}"}
        assert get(got, "torpor_keeper_host_bytes", **labels) == written[rank]["kept"] >= 3 << 20
        assert get(got, "torpor_keeper_backup_bytes", **labels) == written[rank]["published"] == 3 << 20
        assert get(got, "torpor_keeper_up", **labels) == 1
        assert get(got, "torpor_keeper_fallbacks_total", **labels) == 0
