"""GPU soak: 50 sleep/wake cycles of every kind through SleepController and the real TaggedAllocator, nothing lost or leaked.

Each cycle is one of: level 1 full wake, level 1 selective wake weights-first,
level 1 selective wake kv-first, level 2 with a weight reload. Two graphs
captured into the cudagraph pool (each reading a pool constant written once
after capture) must replay bit-exact after every wake; device memory after each
wake stays within 2 MiB of the first; host memory stays flat; sleep and wake
times do not drift; the event log replays to the live state every cycle.

Figures go to ``$TORPOR_SOAK_OUT`` (else ``$OUT``, else the test's tmp dir) as
``soak.json`` and ``soak.md``, and a summary table is printed. Run with
``scripts/gpu-suite soak`` (each GPU test in a fresh process).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from torpor import SleepController, State
from torpor.allocator import TaggedAllocator
from torpor.statemachine.log.reader import replay
from torpor.units import MiB

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="needs torch (the cuda extra) and a CUDA GPU")

CYCLES = 50
KINDS = ("l1-full", "l1-weights-first", "l1-kv-first", "l2-reload")
DEVICE_TOLERANCE = 2 * MiB
HOST_TOLERANCE = 64 * MiB
WIDTH = 1024


@dataclass
class Graph:
    """One captured graph with the output it must reproduce and the pool constant it reads."""

    site: str
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor
    const: torch.Tensor
    const_ref: torch.Tensor
    ref: torch.Tensor


@dataclass
class Workload:
    """Weights, KV cache and runtime tensors under their tags, and graphs in the cudagraph pool."""

    alloc: TaggedAllocator
    ctl: SleepController
    log: Path
    w: torch.Tensor
    w_host: torch.Tensor
    w_ref: torch.Tensor
    kv: torch.Tensor
    rt: torch.Tensor
    rt_ref: torch.Tensor
    x: torch.Tensor
    graphs: list[Graph] = field(default_factory=list)

    def replays_exact(self) -> list[str]:
        """Replay every graph; return the sites whose output differs from the awake reference."""
        bad = []
        for g in self.graphs:
            g.out.fill_(float("nan"))
            g.graph.replay()
        torch.cuda.synchronize()
        for g in self.graphs:
            if not torch.equal(g.out, g.ref):
                bad.append(g.site)
        return bad


def _rss() -> int:
    """Resident set size of this process in bytes (pinned host memory included once touched)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _device_used() -> int:
    """Device bytes in use (driver's view) once torch has returned its unused default-pool cache."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _capture(
    ctl: SleepController, x: torch.Tensor, w: torch.Tensor, kv: torch.Tensor, rt: torch.Tensor, batch: int, seed: int
) -> Graph:
    site = f"soak.forward batch={batch}"
    g = torch.cuda.CUDAGraph()
    with ctl.capture(site) as cap, cap.graph(g):
        const = torch.empty(batch, WIDTH, device="cuda")
        h = x[:batch] @ w
        kv[seed : seed + batch].copy_(h)  # the graph writes the KV cache before it reads it
        out = h * 0.5 + kv[seed : seed + batch] + rt[:batch] + const
    gen = torch.Generator(device="cuda").manual_seed(seed)
    const.copy_(torch.rand(batch, WIDTH, device="cuda", generator=gen))  # written once, after capture
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    return Graph(site, g, out, const, const.clone(), out.clone())


def _build(log: Path, weights_mib: int = 256, kv_mib: int = 256, rt_mib: int = 64) -> Workload:
    torch.manual_seed(1234)
    alloc = TaggedAllocator()
    ctl = SleepController(alloc, log)
    rows = weights_mib * MiB // 4 // WIDTH
    with alloc.use_memory_pool("weights"):
        w = torch.randn(rows, WIDTH, device="cuda")
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.randn(kv_mib * MiB // 4 // WIDTH, WIDTH, device="cuda")
    with alloc.use_memory_pool("runtime"):
        rt = torch.randn(rt_mib * MiB // 4 // WIDTH, WIDTH, device="cuda")
        x = torch.randn(64, rows, device="cuda")
    # warm up cuBLAS on a side stream before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _ = x @ w
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs = [_capture(ctl, x, w, kv, rt, batch, seed) for batch, seed in ((8, 0), (64, 100))]
    w_host = w.cpu()
    work = Workload(alloc, ctl, log, w, w_host, w.clone(), kv, rt, rt.clone(), x, graphs)
    alloc.wait_host_ready(120)
    return work


@dataclass
class Cycle:
    """What one cycle measured."""

    n: int
    kind: str
    sleep_s: float
    wake_s: float
    tagged_mib: float
    freed_mib: float
    device_used_mib: float
    rss_mib: float
    pinned_mib: float
    exact: bool
    states: list[str]


def _cycle(work: Workload, n: int, kind: str) -> Cycle:
    ctl = work.ctl
    awake_used = _device_used()
    tagged = sum(u.resident for u in work.alloc.usage().values())
    level = 2 if kind == "l2-reload" else 1
    t0 = time.perf_counter()
    ctl.sleep(level)
    sleep_s = time.perf_counter() - t0
    asleep_used = _device_used()
    assert ctl.state is (State.ASLEEP_L2 if level == 2 else State.ASLEEP_L1)
    wakes: list[list[str] | None] = {
        "l1-full": [None],
        "l1-weights-first": [["weights"], ["kv_cache"]],
        "l1-kv-first": [["kv_cache"], ["weights"]],
        "l2-reload": [None],
    }[kind]
    states = []
    wake_s = 0.0
    for tags in wakes:
        t0 = time.perf_counter()
        ctl.wake(tags)
        wake_s += time.perf_counter() - t0
        states.append(ctl.state.value)
        if tags is not None and ctl.state is State.PARTIALLY_AWAKE:
            # any wake restores the graph pool: its write-once constants are back already
            for g in work.graphs:
                assert torch.equal(g.const, g.const_ref), f"cycle {n}: {g.site} constant not back after {tags}"
    assert ctl.state is State.AWAKE, f"cycle {n} ({kind}) ended in {ctl.state}"
    if level == 2:
        work.w.copy_(work.w_host)  # the engine reloads its weights (host to device, no device temporary)
    torch.cuda.synchronize()
    bad = work.replays_exact()
    exact = not bad and bool(torch.equal(work.w, work.w_ref)) and bool(torch.equal(work.rt, work.rt_ref))
    assert exact, f"cycle {n} ({kind}): graphs {bad} or tensors differ after wake"
    assert replay(work.log).to_dict() == ctl.projection.to_dict(), f"cycle {n}: replay(log) differs from live"
    return Cycle(
        n=n,
        kind=kind,
        sleep_s=sleep_s,
        wake_s=wake_s,
        tagged_mib=tagged / MiB,
        freed_mib=(awake_used - asleep_used) / MiB,
        device_used_mib=_device_used() / MiB,
        rss_mib=_rss() / MiB,
        pinned_mib=work.alloc.pinned_bytes() / MiB,
        exact=exact,
        states=states,
    )


def _out_dir(tmp_path: Path) -> Path:
    raw = os.environ.get("TORPOR_SOAK_OUT") or os.environ.get("OUT")
    out = Path(raw) if raw else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    return out


def _summary(cycles: list[Cycle], meta: dict[str, Any]) -> str:
    lines = [
        f"# torpor GPU soak: {len(cycles)} cycles on {meta['gpu']}",
        "",
        f"tagged {meta['tagged_mib']:.0f} MiB (weights {meta['weights_mib']} MiB, kv_cache {meta['kv_mib']} MiB, "
        f"runtime {meta['rt_mib']} MiB, cudagraph {meta['cudagraph_mib']:.1f} MiB); torch {meta['torch']}; {meta['date']}",
        "",
        "| kind | cycles | sleep median (min-max) s | wake median (min-max) s | freed MiB | exact |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind in KINDS:
        cs = [c for c in cycles if c.kind == kind]
        if not cs:
            continue
        sl = [c.sleep_s for c in cs]
        wk = [c.wake_s for c in cs]
        lines.append(
            f"| {kind} | {len(cs)} | {statistics.median(sl):.3f} ({min(sl):.3f}-{max(sl):.3f}) | "
            f"{statistics.median(wk):.3f} ({min(wk):.3f}-{max(wk):.3f}) | "
            f"{statistics.median(c.freed_mib for c in cs):.0f} | {sum(c.exact for c in cs)}/{len(cs)} |"
        )
    dev = [c.device_used_mib for c in cycles]
    rss = [c.rss_mib for c in cycles][1:] or [c.rss_mib for c in cycles]
    pin = [c.pinned_mib for c in cycles]
    lines += [
        "",
        f"device used after each wake: {min(dev):.1f}-{max(dev):.1f} MiB (spread {max(dev) - min(dev):.2f} MiB, "
        f"first {dev[0]:.1f} MiB, max drift from first {max(abs(d - dev[0]) for d in dev):.2f} MiB)",
        f"host RSS after each wake (cycles 2-{len(cycles)}): {min(rss):.0f}-{max(rss):.0f} MiB; "
        f"pinned {min(pin):.0f}-{max(pin):.0f} MiB",
        "",
    ]
    return "\n".join(lines)


def test_soak_fifty_mixed_cycles(tmp_path: Path) -> None:
    """50 mixed cycles: every replay bit-exact, device memory within 2 MiB of the first wake, host flat, times stable."""
    out = _out_dir(tmp_path)
    work = _build(tmp_path / "soak.jsonl")
    tagged = sum(u.resident for u in work.alloc.usage().values())
    cycles: list[Cycle] = []
    try:
        for n in range(CYCLES):
            cycles.append(_cycle(work, n + 1, KINDS[n % len(KINDS)]))
    finally:
        usage = work.alloc.usage()
        meta = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "tagged_mib": tagged / MiB,
            "weights_mib": 256,
            "kv_mib": 256,
            "rt_mib": 64,
            "cudagraph_mib": usage["cudagraph"].resident / MiB if "cudagraph" in usage else 0.0,
            "command": "scripts/gpu-suite soak",
        }
        text = _summary(cycles, meta) if cycles else "no cycle completed\n"
        (out / "soak.json").write_text(json.dumps({"meta": meta, "cycles": [asdict(c) for c in cycles]}, indent=1))
        (out / "soak.md").write_text(text)
        print("\n" + text)

    assert len(cycles) == CYCLES
    assert work.alloc.pending_errors() == []
    assert work.ctl.projection.refusals == 0
    # every cycle's sleep released the tagged memory, and the tagged memory stayed the same size
    for c in cycles:
        assert c.freed_mib >= 0.99 * c.tagged_mib, (
            f"cycle {c.n} ({c.kind}) freed {c.freed_mib:.0f} of {c.tagged_mib:.0f} MiB"
        )
    assert max(c.tagged_mib for c in cycles) - min(c.tagged_mib for c in cycles) <= 2, "tagged memory changed size"
    # selective wakes passed through partially_awake
    for c in cycles:
        if c.kind in ("l1-weights-first", "l1-kv-first"):
            assert c.states == ["partially_awake", "awake"], (c.n, c.states)
    # device memory after each wake within 2 MiB of the first
    first = cycles[0].device_used_mib * MiB
    drift = [
        (c.n, c.device_used_mib * MiB - first)
        for c in cycles
        if abs(c.device_used_mib * MiB - first) > DEVICE_TOLERANCE
    ]
    assert not drift, f"device memory after wake drifted beyond 2 MiB: {[(n, round(d / MiB, 2)) for n, d in drift[:5]]}"
    # host memory flat: pinned never grows after the first cycle, RSS within a small band
    assert max(c.pinned_mib for c in cycles[1:]) <= cycles[0].pinned_mib
    rss = [c.rss_mib * MiB for c in cycles[1:]]
    assert max(rss) - min(rss) <= HOST_TOLERANCE, f"host RSS moved {(max(rss) - min(rss)) / MiB:.0f} MiB"
    # times stable: the last cycles of each kind are no slower than the early ones (beyond noise)
    for kind in KINDS:
        cs = [c for c in cycles[1:] if c.kind == kind]
        half = len(cs) // 2
        for what in ("sleep_s", "wake_s"):
            early = statistics.median(getattr(c, what) for c in cs[:half])
            late = statistics.median(getattr(c, what) for c in cs[half:])
            assert late <= 1.5 * early + 0.02, f"{kind} {what} drifted: {early:.3f} s early, {late:.3f} s late"
