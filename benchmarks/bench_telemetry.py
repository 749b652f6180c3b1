"""Benchmark: Prometheus scrape time for 8 ranks x 6 tags, and the cost telemetry subscribers add to a transition.

Run: python benchmarks/bench_telemetry.py [--scrapes 500] [--cycles 2000]
Memory is torpor.testing.FakeMemory, so the figures are telemetry's own cost.
A transition is one state change (a sleep or a wake is two: awake ->
suspending -> asleep_l1); a cycle is sleep(1) + wake() with 6 tags, 4
transitions and about 22 events. The multiprocess figures come from a child
process started with PROMETHEUS_MULTIPROC_DIR set (prometheus-client decides
its value store at import).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from torpor import SleepController
from torpor.statemachine.core.events import Event
from torpor.telemetry import Server, attach
from torpor.testing import FakeMemory, capture_events

TAGS = {"weights": 2**34, "kv_cache": 2**35, "cudagraph": 2**31, "runtime": 2**28, "workspace": 2**27, "lora": 2**26}
RANKS = 8
TRANSITIONS_PER_CYCLE = 4


def _busy(controller: SleepController) -> None:
    """Fill counters and histograms the way a real run would (both levels, partial and full wakes)."""
    for _ in range(3):
        controller.sleep(1)
        controller.wake(["weights"])
        controller.wake(["kv_cache"])
        controller.sleep(2)
        controller.wake()


def _timed(fn: Callable[[], object], n: int, before: Callable[[], object] | None = None) -> tuple[float, float]:
    """(median, p99) milliseconds of ``n`` calls of ``fn``; ``before`` runs untimed ahead of each."""
    times = []
    for _ in range(n):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times) * 1e3, times[max(0, int(len(times) * 0.99) - 1)] * 1e3


def scrape_times(scrapes: int) -> dict[str, Any]:
    """Milliseconds per scrape of one registry holding 8 ranks x 6 tags, three ways."""
    registry = CollectorRegistry()
    controllers = [SleepController(FakeMemory(TAGS), engine="bench", rank=r) for r in range(RANKS)]
    handles = [attach(c, registry=registry, otel=False, multiprocess=False) for c in controllers]
    for controller in controllers:
        _busy(controller)
    collector = handles[0].collector
    if collector is None:
        msg = "attach did not create a collector"
        raise RuntimeError(msg)
    text = generate_latest(registry)
    if collector.exposition() != text:
        msg = "the endpoint's rendering differs from generate_latest"
        raise RuntimeError(msg)

    def after_events() -> None:
        for controller in controllers:  # every rank records an event, so no rank's samples are cached
            controller.observe()

    server = Server(
        None,
        0,
        "127.0.0.1",
        registry,
        max_wait=1.0,
        max_events=1,
        max_waiters=1,
        render=collector.exposition,
    )
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)

    def scrape(accept_encoding: str) -> None:
        connection.request("GET", "/metrics", headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": accept_encoding})
        response = connection.getresponse()
        body = response.read()
        if response.status != 200 or not body:
            msg = f"scrape answered {response.status}"
            raise RuntimeError(msg)

    try:
        http_plain = _timed(lambda: scrape("identity"), scrapes, before=after_events)
        http_gzip = _timed(lambda: scrape("gzip"), scrapes, before=after_events)
    finally:
        connection.close()
        server.close()
    return {
        "http_prometheus_accept": http_plain,
        "http_prometheus_accept_gzip": http_gzip,
        "openmetrics_generate_latest": _timed(lambda: openmetrics.generate_latest(registry), scrapes),
        "samples": sum(1 for line in text.splitlines() if line and not line.startswith(b"#")),
        "bytes": len(text),
        "endpoint_unchanged": _timed(collector.exposition, scrapes),
        "endpoint_changed": _timed(collector.exposition, scrapes, before=after_events),
        "generate_latest": _timed(lambda: generate_latest(registry), scrapes),
    }


#: The Accept header Prometheus 3 sends on every scrape (scrape_protocols default).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


def _cycle_events() -> list[Event]:
    controller = SleepController(FakeMemory(TAGS), engine="bench", rank=0)
    with capture_events(controller) as events:
        controller.sleep(1)
        controller.wake()
    return list(events)


def subscriber_cost(cycles: int, setup: Callable[[SleepController], Any]) -> float:
    """Microseconds the telemetry subscriber spends per transition, fed one cycle's events ``cycles`` times."""
    events = _cycle_events()
    controller = SleepController(FakeMemory(TAGS), engine="bench", rank=0)
    handle = setup(controller)
    tracker = handle.tracker
    seq = controller.last_seq
    feed = []
    for _ in range(cycles):
        for event in events:
            seq += 1
            feed.append(dataclasses.replace(event, seq=seq))
    on_event = tracker._on_event
    start = time.perf_counter()
    for event in feed:
        on_event(event)
    elapsed = time.perf_counter() - start
    handle.detach()
    return elapsed / (cycles * TRANSITIONS_PER_CYCLE) * 1e6


def best_subscriber_cost(cycles: int, setup: Callable[[SleepController], Any], repeats: int = 5) -> float:
    """The lowest of ``repeats`` runs of :func:`subscriber_cost` (the least disturbed by other load)."""
    return min(subscriber_cost(cycles, setup) for _ in range(repeats))


def end_to_end(cycles: int, setup: Callable[[SleepController], Any]) -> tuple[float, float]:
    """Microseconds per transition of real sleep/wake cycles (bare, with telemetry), measured in alternating blocks."""
    bare = SleepController(FakeMemory(TAGS), engine="bench", rank=0)
    instrumented = SleepController(FakeMemory(TAGS), engine="bench", rank=1)
    handle = setup(instrumented)
    best = {id(bare): float("inf"), id(instrumented): float("inf")}
    block = max(1, cycles // 20)
    for _ in range(20):
        for controller in (bare, instrumented):
            start = time.perf_counter()
            for _ in range(block):
                controller.sleep(1)
                controller.wake()
            per = (time.perf_counter() - start) / (block * TRANSITIONS_PER_CYCLE)
            best[id(controller)] = min(best[id(controller)], per)
    handle.detach()
    return best[id(bare)] * 1e6, best[id(instrumented)] * 1e6


def _prometheus(c: SleepController) -> Any:
    return attach(c, registry=CollectorRegistry(), otel=False, multiprocess=False)


def _default(c: SleepController) -> Any:
    return attach(c, registry=CollectorRegistry(), multiprocess=False)


def _otel_sdk(c: SleepController) -> Any:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    return attach(c, registry=CollectorRegistry(), tracer_provider=tracer_provider, meter_provider=meter_provider)


def _multiprocess(c: SleepController) -> Any:
    return attach(c, otel=False, multiprocess=True)


def multiprocess_figures(cycles: int, scrapes: int) -> dict[str, float]:
    """Subscriber cost and merged-scrape time in multiprocess mode, measured in a child process."""
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": directory}
        cmd = [sys.executable, __file__, "--child-multiprocess", "--cycles", str(cycles), "--scrapes", str(scrapes)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=600)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _child_multiprocess(cycles: int, scrapes: int) -> None:
    from torpor.telemetry import multiprocess_registry

    cost = best_subscriber_cost(cycles, _multiprocess)
    controllers = [SleepController(FakeMemory(TAGS), engine="bench-mp", rank=r) for r in range(RANKS)]
    for controller in controllers:
        _multiprocess(controller)
        _busy(controller)
    registry = multiprocess_registry()
    times = []
    for _ in range(max(10, scrapes // 10)):
        start = time.perf_counter()
        generate_latest(registry)
        times.append(time.perf_counter() - start)
    print(json.dumps({"subscriber_us": cost, "merged_scrape_ms": statistics.median(times) * 1e3}))


def main() -> None:
    """Print the figures as Markdown."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scrapes", type=int, default=500)
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--child-multiprocess", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_multiprocess:
        _child_multiprocess(args.cycles, args.scrapes)
        return
    scrape = scrape_times(args.scrapes)
    mp = multiprocess_figures(args.cycles, args.scrapes)
    rows = [
        ("Prometheus collector only", _prometheus),
        ("Prometheus + OpenTelemetry, no SDK (attach() default)", _default),
        ("Prometheus + OpenTelemetry SDK (BatchSpanProcessor, in-memory exporter and reader)", _otel_sdk),
    ]
    print(f"python {platform.python_version()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"load average {os.getloadavg()[0]:.2f}, date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print(f"## Scrape: {RANKS} ranks x {len(TAGS)} tags ({scrape['samples']} samples, {scrape['bytes']} bytes)\n")
    print("| scrape | median | p99 | target |")
    print("| --- | --- | --- | --- |")
    rows_scrape = [
        ("endpoint /metrics, every rank changed since the last scrape", scrape["endpoint_changed"]),
        ("endpoint /metrics, nothing changed (cached samples)", scrape["endpoint_unchanged"]),
        ("generate_latest(registry) (a shared registry, e.g. the global one)", scrape["generate_latest"]),
        ("HTTP GET /metrics with Prometheus 3's Accept header, every rank changed", scrape["http_prometheus_accept"]),
        ("the same with Accept-Encoding: gzip (what Prometheus sends)", scrape["http_prometheus_accept_gzip"]),
        (
            "OpenMetrics through prometheus-client (what that Accept header used to get)",
            scrape["openmetrics_generate_latest"],
        ),
    ]
    for name, (median, p99) in rows_scrape:
        print(f"| {name} | {median:.2f} ms | {p99:.2f} ms | < 5 ms |")
    print(f"| multiprocess: MultiProcessCollector merging 8 ranks' files | {mp['merged_scrape_ms']:.2f} ms | | |")
    print(f"\n## Cost per transition ({args.cycles} sleep(1)/wake() cycles, 6 tags, 4 transitions per cycle)\n")
    print(
        "| telemetry | subscriber time per transition | end to end per transition, bare -> with (best block) | target |"
    )
    print("| --- | --- | --- | --- |")
    for name, setup in rows:
        cost = best_subscriber_cost(args.cycles, setup)
        bare, e2e = end_to_end(args.cycles, setup)
        print(f"| {name} | {cost:.1f} µs | {bare:.1f} -> {e2e:.1f} µs (+{e2e - bare:.1f}) | < 200 µs |")
    print(f"| multiprocess files (PROMETHEUS_MULTIPROC_DIR) | {mp['subscriber_us']:.1f} µs | | < 200 µs |")


if __name__ == "__main__":
    main()
