"""Tests for torpor.telemetry.prometheus: the scrape-time collector and its exposition."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from support import RigMaker, samples, value

from torpor import EventKind, SleepController, State
from torpor.errors import InvalidTransition, MemoryOperationFailed
from torpor.statemachine.core.events import SleepRequested
from torpor.telemetry import METRICS, attach
from torpor.testing import FakeMemory
from torpor.units import MiB

TAGS = {"weights": 4000, "kv_cache": 8000, "cudagraph": 300, "runtime": 50}


def run_cycle(controller: SleepController) -> None:
    """Sleep at level 1, get refused once, wake weights then the rest."""
    controller.sleep(1)
    with pytest.raises(InvalidTransition):
        controller.sleep(1)
    controller.wake(["weights"])
    controller.wake(["kv_cache"])


def test_state_is_one_series_per_state_with_one_set() -> None:
    """torpor_state has a series for every state; only the current one is 1, and it follows the controller."""
    registry = CollectorRegistry()
    controller = SleepController(FakeMemory(TAGS), engine="e", rank=2)
    attach(controller, registry=registry, otel=False)
    controller.sleep(2)
    got = samples(registry)
    states = {dict(k[1])["state"]: v for k, v in got.items() if k[0] == "torpor_state"}
    assert set(states) == {s.value for s in State}
    assert {s for s, v in states.items() if v == 1.0} == {"asleep_l2"}
    controller.wake()
    assert value(samples(registry), "torpor_state", torpor_engine="e", torpor_rank="2", state="awake") == 1.0


def test_bytes_per_tag_and_residency_follow_the_policy() -> None:
    """After a level-1 sleep, weights are on the host, kv_cache discarded, nothing resident."""
    registry = CollectorRegistry()
    controller = SleepController(FakeMemory(TAGS), engine="e", rank=0)
    attach(controller, registry=registry, otel=False)
    base = {"torpor_engine": "e", "torpor_rank": "0"}
    assert value(samples(registry), "torpor_tag_bytes", **base, tag="weights", residency="resident") == 4000
    controller.sleep(1)
    got = samples(registry)
    assert value(got, "torpor_tag_bytes", **base, tag="weights", residency="host") == 4000
    assert value(got, "torpor_tag_bytes", **base, tag="kv_cache", residency="discarded") == 8000
    assert value(got, "torpor_tag_bytes", **base, tag="cudagraph", residency="host") == 300
    resident = sum(v for k, v in got.items() if k[0] == "torpor_tag_bytes" and ("residency", "resident") in k[1])
    assert resident == 0


def test_counters_and_histograms_count_what_happened() -> None:
    """Transitions, durations, transfers, refusals and the info metric match one scripted cycle."""
    registry = CollectorRegistry()
    controller = SleepController(FakeMemory(TAGS), engine="e", rank=1)
    attach(controller, registry=registry, otel=False)
    run_cycle(controller)
    got = samples(registry)
    base = {"torpor_engine": "e", "torpor_rank": "1"}
    assert value(got, "torpor_transitions_total", **base, from_state="awake", to_state="suspending") == 1
    assert value(got, "torpor_transitions_total", **base, from_state="resuming", to_state="partially_awake") == 1
    assert value(got, "torpor_transitions_total", **base, from_state="resuming", to_state="awake") == 1
    assert value(got, "torpor_sleep_duration_seconds_count", **base, level="1") == 1
    assert value(got, "torpor_wake_duration_seconds_count", **base, tags="weights") == 1
    assert value(got, "torpor_wake_duration_seconds_count", **base, tags="kv_cache") == 1
    assert value(got, "torpor_wake_duration_seconds_bucket", **base, tags="kv_cache", le="+Inf") == 1
    assert value(got, "torpor_refusals_total", **base, command="sleep", error_type="InvalidTransition") == 1
    assert value(got, "torpor_tag_transfer_bytes_total", **base, tag="weights", direction="device_to_host") == 4000
    assert value(got, "torpor_tag_transfer_bytes_total", **base, tag="weights", direction="host_to_device") == 4000
    assert (
        "torpor_tag_transfer_bytes_total",
        frozenset({**base, "tag": "kv_cache", "direction": "host_to_device"}.items()),
    ) not in got
    assert value(got, "torpor_info", **base, version="0.1.0", driver="FakeMemory") == 1


def test_failures_count_aborted_sleeps_by_error_class() -> None:
    """A sleep whose backup fails counts in torpor_failures_total with the error class, not as a completed sleep."""
    registry = CollectorRegistry()
    memory = FakeMemory(TAGS)
    controller = SleepController(memory)
    attach(controller, registry=registry, otel=False)
    memory.fail_once("backup")
    with pytest.raises(MemoryOperationFailed):
        controller.sleep(1)
    got = samples(registry)
    base = {"torpor_engine": "default", "torpor_rank": "0"}
    assert value(got, "torpor_failures_total", **base, operation="sleep", error_type="MemoryOperationFailed") == 1
    assert ("torpor_sleep_duration_seconds_count", frozenset({**base, "level": "1"}.items())) not in got
    assert value(got, "torpor_state", **base, state="awake") == 1


def test_ranks_in_one_registry_are_separate_series() -> None:
    """Several controllers attached to one registry share one collector and keep their own series."""
    registry = CollectorRegistry()
    controllers = [SleepController(FakeMemory(TAGS), engine="e", rank=r) for r in range(3)]
    handles = [attach(c, registry=registry, otel=False) for c in controllers]
    assert len({id(h.collector) for h in handles}) == 1
    controllers[1].sleep(1)
    got = samples(registry)
    assert value(got, "torpor_state", torpor_engine="e", torpor_rank="0", state="awake") == 1
    assert value(got, "torpor_state", torpor_engine="e", torpor_rank="1", state="asleep_l1") == 1
    assert value(got, "torpor_state", torpor_engine="e", torpor_rank="2", state="awake") == 1


def test_detach_removes_the_series_and_the_collector() -> None:
    """After every handle detaches, the registry exposes no torpor metric and the controller still works."""
    registry = CollectorRegistry()
    controller = SleepController(FakeMemory(TAGS))
    handle = attach(controller, registry=registry, otel=False)
    handle.detach()
    handle.detach()
    assert not [k for k in samples(registry) if k[0].startswith("torpor_")]
    controller.sleep(1)
    attach(controller, registry=registry, otel=False)
    assert samples(registry)


def test_telemetry_changes_nothing_in_the_controller() -> None:
    """The same commands give the same memory calls and projection with and without telemetry."""
    runs = []
    for on in (False, True):
        memory = FakeMemory(TAGS)
        controller = SleepController(memory, engine="e")
        if on:
            attach(controller, registry=CollectorRegistry())
        run_cycle(controller)
        proj = controller.projection.to_dict()
        for volatile in ("since_wall", "last_wall", "pid"):
            proj.pop(volatile)
        runs.append((memory.calls, proj))
    assert runs[0] == runs[1]


def test_metric_names_have_the_prefix_and_no_colons() -> None:
    """Every exposed family is torpor_-prefixed and colon-free (vLLM owns the vllm: names)."""
    registry = CollectorRegistry()
    attach(SleepController(FakeMemory(TAGS)), registry=registry, otel=False)
    names = {k[0] for k in samples(registry)}
    assert names
    assert all(n.startswith("torpor_") and ":" not in n for n in names)
    assert all(n.startswith("torpor_") and ":" not in n for n in METRICS)


def test_the_global_registry_is_the_default() -> None:
    """attach without a registry registers in prometheus_client's global REGISTRY, and detach removes it."""
    from prometheus_client import REGISTRY

    handle = attach(SleepController(FakeMemory(TAGS), engine="global-test"), otel=False)
    try:
        assert b'torpor_engine="global-test"' in generate_latest(REGISTRY)
    finally:
        handle.detach()
    assert b'torpor_engine="global-test"' not in generate_latest(REGISTRY)


@pytest.mark.prometheus
def test_promtool_check_metrics_reports_nothing() -> None:
    """promtool check metrics finds no problem in the exposition of a full cycle."""
    registry = CollectorRegistry()
    memory = FakeMemory(TAGS)
    controller = SleepController(memory, engine="e")
    attach(controller, registry=registry, otel=False)
    run_cycle(controller)
    memory.fail_once("restore", "weights")
    controller.sleep(2)
    with pytest.raises(MemoryOperationFailed):
        controller.wake()
    text = generate_latest(registry)
    assert b"torpor_failures_total" in text
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == b""
    assert result.stderr.strip() == b""


def test_direct_rendering_is_the_same_text_as_generate_latest() -> None:
    """exposition() renders byte-for-byte what generate_latest gives, escapes included, and follows new events."""
    registry = CollectorRegistry()
    controllers = [SleepController(FakeMemory(TAGS), engine='odd "name"\\with 模型', rank=r) for r in range(3)]
    handles = [attach(c, registry=registry, otel=False) for c in controllers]
    for controller in controllers[:2]:
        run_cycle(controller)
    collector = handles[0].collector
    assert collector is not None
    assert collector.exposition() == generate_latest(registry)
    controllers[2].sleep(2)
    text = collector.exposition()
    assert text == generate_latest(registry)
    assert (
        'torpor_state{state="asleep_l2",torpor_engine="odd \\"name\\"\\\\with 模型",torpor_rank="2"} 1.0'.encode()
        in text
    )


def test_scrapes_during_transitions_are_consistent() -> None:
    """Scraping from another thread while the controller cycles never fails and always shows exactly one state."""
    import threading

    registry = CollectorRegistry()
    controller = SleepController(FakeMemory(TAGS), engine="e")
    handle = attach(controller, registry=registry, otel=False)
    assert handle.collector is not None
    collector = handle.collector
    stop = threading.Event()
    errors: list[BaseException] = []

    def cycle() -> None:
        try:
            while not stop.is_set():
                controller.sleep(1)
                controller.wake()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    worker = threading.Thread(target=cycle)
    worker.start()
    try:
        for _ in range(200):
            text = collector.exposition().decode()
            ones = [line for line in text.splitlines() if line.startswith("torpor_state{") and line.endswith(" 1.0")]
            assert len(ones) == 1, ones
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not errors


def test_a_source_needs_only_projection_events_and_subscribe() -> None:
    """Telemetry works with any object offering projection, events and subscribe: it calls no command."""

    class ReadOnly:
        def __init__(self, controller: SleepController) -> None:
            self._c = controller
            self.engine, self.rank = controller.engine, controller.rank

        @property
        def projection(self):  # type: ignore[no-untyped-def]
            return self._c.projection

        def events(self, after: int = 0):  # type: ignore[no-untyped-def]
            return self._c.events(after)

        def subscribe(self, callback, kinds=None):  # type: ignore[no-untyped-def]
            return self._c.subscribe(callback, kinds)

    registry = CollectorRegistry()
    controller = SleepController(FakeMemory(TAGS), engine="ro", rank=4)
    attach(ReadOnly(controller), registry=registry, otel=False)
    controller.sleep(1)
    got = samples(registry)
    assert value(got, "torpor_state", torpor_engine="ro", torpor_rank="4", state="asleep_l1") == 1
    assert value(got, "torpor_info", torpor_engine="ro", torpor_rank="4", version="0.1.0", driver="FakeMemory") == 1


def test_an_interrupted_log_shows_the_transitional_state(tmp_path: Path) -> None:
    """A controller reopened on a log that ends mid-sleep exposes 'suspending' until it recovers."""
    controller = SleepController(FakeMemory(TAGS), log=tmp_path, engine="crash", fsync=False)
    controller._recorder.record(SleepRequested(level=1, plan={}, usage={}))  # what a crash mid-sleep leaves
    controller.log.close()  # type: ignore[union-attr]
    reopened = SleepController(FakeMemory(TAGS), log=tmp_path, engine="crash", fsync=False)
    registry = CollectorRegistry()
    attach(reopened, registry=registry, otel=False)
    assert value(samples(registry), "torpor_state", torpor_engine="crash", torpor_rank="0", state="suspending") == 1
    reopened.recover()
    got = samples(registry)
    assert value(got, "torpor_state", torpor_engine="crash", torpor_rank="0", state="awake") == 1
    assert (
        value(
            got,
            "torpor_transitions_total",
            torpor_engine="crash",
            torpor_rank="0",
            from_state="suspending",
            to_state="awake",
        )
        == 1
    )


def test_exposition_of_a_registry_renders_torpor_families_only() -> None:
    """exposition(registry) gives torpor's text for that registry, and nothing for a registry without torpor."""
    from prometheus_client import Gauge

    from torpor.telemetry import exposition

    registry = CollectorRegistry()
    Gauge("someone_else", "not torpor", registry=registry).set(1)
    assert exposition(registry) == b""
    attach(SleepController(FakeMemory(TAGS), engine="x"), registry=registry, otel=False)
    text = exposition(registry)
    assert b'torpor_state{state="awake",torpor_engine="x",torpor_rank="0"} 1.0' in text
    assert b"someone_else" not in text
    assert text in generate_latest(registry)


def test_a_second_controller_with_the_same_rank_is_refused() -> None:
    """Attaching another controller with the same engine and rank to one registry raises DuplicateRank and changes nothing."""
    from torpor.telemetry import DuplicateRank

    registry = CollectorRegistry()
    first = SleepController(FakeMemory(TAGS), engine="dup", rank=0)
    second = SleepController(FakeMemory(TAGS), engine="dup", rank=0)
    handle = attach(first, registry=registry, otel=False)
    with pytest.raises(DuplicateRank, match="engine 'dup' rank 0"):
        attach(second, registry=registry, otel=False)
    assert len(second._recorder.subscribers) == 0
    first.sleep(1)
    assert value(samples(registry), "torpor_state", torpor_engine="dup", torpor_rank="0", state="asleep_l1") == 1
    handle.detach()
    attach(second, registry=registry, otel=False)
    assert value(samples(registry), "torpor_state", torpor_engine="dup", torpor_rank="0", state="awake") == 1


def test_host_budget_and_what_stays_on_the_device_while_asleep(make_rig: RigMaker) -> None:
    """torpor_host_budget_bytes shows the budget (+Inf without one); torpor_asleep_device_bytes splits what stayed at sleep."""
    from torpor import HostMemoryPolicy, Policy

    alloc = make_rig(overhead=3 << 20, slab_bytes=0).allocator
    alloc.allocate(2 << 20, "weights")
    registry = CollectorRegistry()
    controller = SleepController(alloc, policy=Policy(host=HostMemoryPolicy(budget_bytes=8 << 20)), engine="e")
    attach(controller, registry=registry, otel=False)
    base = {"torpor_engine": "e", "torpor_rank": "0"}
    assert value(samples(registry), "torpor_host_budget_bytes", **base) == 8 << 20
    assert not [k for k in samples(registry) if k[0] == "torpor_asleep_device_bytes"]
    controller.sleep(1)
    got = samples(registry)
    assert value(got, "torpor_asleep_device_bytes", **base, part="untagged") == 3 << 20
    assert value(got, "torpor_asleep_device_bytes", **base, part="tagged") == 0
    assert value(got, "torpor_pinned_host_bytes", **base) == 2 << 20
    other = SleepController(FakeMemory(TAGS), policy=Policy(host=HostMemoryPolicy()), engine="f")
    attach(other, registry=registry, otel=False)
    assert value(samples(registry), "torpor_host_budget_bytes", torpor_engine="f", torpor_rank="0") == float("inf")


# -- a keeper backing the allocator's host memory (torpor.keeper) -------------------------------------------------


@pytest.fixture
def keeper_sock(tmp_path: Path) -> Iterator[Path]:
    """A keeper process (``torpor keeper serve``) and its socket."""
    from keeper_engine import running_keeper

    sock = tmp_path / "k" / "keeper.sock"
    with running_keeper(sock):
        yield sock


def _kept_engine(
    make_rig: RigMaker, engine: str, sock: Path | None, registry: CollectorRegistry
) -> tuple[SleepController, Any]:
    """Telemetry attached first (as vLLM's wiring does), then a keeper backing; 3 MiB of tracked weights."""
    from torpor.allocator.host.offload import HostPolicy
    from torpor.keeper import ModelIdentity, TensorSpec
    from torpor.keeper import attach as keep

    alloc = make_rig("cuda_like", capacity=256 * MiB, host=HostPolicy(chunk_bytes=2 * MiB)).allocator
    controller = SleepController(alloc, engine=engine)
    attach(controller, registry=registry, otel=False, multiprocess=False)
    address = alloc.allocate(3 * MiB, tag="weights")
    alloc.write(address, b"\x5a" * (3 * MiB))
    backing = None
    if sock is not None:
        backing = keep(alloc, controller, keeper=sock, engine=f"{engine}-keep")
        backing.track(ModelIdentity.of("m", [TensorSpec("w", (3 * MiB,), "uint8", 3 * MiB)]), {"w": address})
    return controller, backing


def test_keeper_bytes_are_on_the_registry_after_a_sleep(keeper_sock: Path, make_rig: RigMaker) -> None:
    """With a keeper backing the allocator, the registry shows its host bytes, the backup published and that it is up."""
    registry = CollectorRegistry()
    controller, backing = _kept_engine(make_rig, "kp", keeper_sock, registry)
    labels = {"torpor_engine": "kp", "torpor_rank": "0", "keeper_engine": "kp-keep"}
    controller.sleep(1)
    got = samples(registry)
    assert value(got, "torpor_keeper_host_bytes", **labels) == backing.kept_bytes >= 3 * MiB
    assert value(got, "torpor_keeper_backup_bytes", **labels) == 3 * MiB
    assert value(got, "torpor_keeper_up", **labels) == 1
    assert value(got, "torpor_keeper_fallbacks_total", **labels) == 0
    controller.wake()
    assert value(samples(registry), "torpor_keeper_backup_bytes", **labels) == 0
    assert "# TYPE torpor_keeper_fallbacks_total counter" in generate_latest(registry).decode()


def test_no_keeper_series_without_a_keeper(make_rig: RigMaker) -> None:
    """An allocator without a keeper backing has no torpor_keeper_* samples (the families are empty)."""
    registry = CollectorRegistry()
    controller, _ = _kept_engine(make_rig, "nk", None, registry)
    controller.sleep(1)
    got = samples(registry)
    assert value(got, "torpor_pinned_host_bytes", torpor_engine="nk", torpor_rank="0") >= 3 * MiB
    assert not [k for k in got if k[0].startswith("torpor_keeper_")]


def test_a_keeper_absent_at_attach_shows_as_down_with_its_fallbacks(tmp_path: Path, make_rig: RigMaker) -> None:
    """A keeper configured but not answering at attach: torpor_keeper_up 0, each range kept in-process counted."""
    registry = CollectorRegistry()
    controller, backing = _kept_engine(make_rig, "ka", tmp_path / "nobody" / "keeper.sock", registry)
    controller.sleep(1)
    got = samples(registry)
    labels = {"torpor_engine": "ka", "torpor_rank": "0", "keeper_engine": "ka-keep"}
    assert backing.gone is not None
    assert value(got, "torpor_keeper_up", **labels) == 0
    assert value(got, "torpor_keeper_fallbacks_total", **labels) == backing.fallbacks >= 1
    assert value(got, "torpor_keeper_host_bytes", **labels) == 0


def test_an_adoption_in_the_log_is_counted() -> None:
    """A backup_adopted event counts the adopted bytes and the adoption, by keeper engine."""
    registry = CollectorRegistry()
    controller = SleepController(FakeMemory(TAGS), engine="ad")
    attach(controller, registry=registry, otel=False, multiprocess=False)
    controller.record(EventKind.BACKUP_ADOPTED, engine="ad-keep", backup="b1", from_pid=7, bytes=5000, tensors=2)
    got = samples(registry)
    labels = {"torpor_engine": "ad", "torpor_rank": "0", "keeper_engine": "ad-keep"}
    assert value(got, "torpor_keeper_adopted_bytes_total", **labels) == 5000
    assert value(got, "torpor_keeper_adoptions_total", **labels) == 1
