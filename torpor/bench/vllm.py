"""``torpor bench --vllm MODEL``: vLLM's ``cumem`` sleep backend against ``torpor`` on one model, in one run.

Each engine runs in its own process (:mod:`torpor.bench.vllm_engine`), in
alternating order (cumem, torpor, torpor, cumem, ...: each backend goes first
and last equally often, so a warming machine or compile cache favours
neither). Per backend the table gives the median over its engines of: the first
level-1 sleep and wake (the cold ones), the later ones (every later cycle), the
level-2 sleep and wake + ``reload_weights``, the device memory freed, the
engine start; and where a later level-1 sleep's time goes (the caller's
``LLM.sleep``, the worker's ``sleep``, the backend's ``suspend``; for torpor also
the per-tag backup and release seconds of its event log). The cProfile of one
extra cycle in each engine's worker is kept in the JSON. Every row is also given
as a multiple of the pinned host-link floor measured at the start of the same run
(:mod:`torpor.bench.linkfloor`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torpor.bench.linkfloor import against_floor, floor_in_child, floor_lines
from torpor.bench.vllm_engine import all_of

BACKENDS = ("cumem", "torpor")


def order(rounds: int, first: str = BACKENDS[0]) -> list[str]:
    """The engines to start: ABBA per round pair, so each backend is first and last equally often."""
    pair = [first, *(b for b in BACKENDS if b != first)]
    out: list[str] = []
    for r in range(rounds):
        out += pair if r % 2 == 0 else list(reversed(pair))
    return out


def run(
    model: str,
    *,
    rounds: int = 2,
    cycles: int = 4,
    l2_cycles: int = 2,
    mode: str = "compile",
    first: str = BACKENDS[0],
    out: Path,
    log: Callable[[str], None] = lambda s: None,
    timeout: float = 600.0,
    floor: Callable[[], tuple[float, float]] = floor_in_child,
) -> dict[str, Any]:
    """Run the engines one after another; the raw results and the summary (also written to ``out/vllm-bench.json``).

    ``floor`` measures the pinned host-link floor (bytes/s each way) before the first engine, on the same GPU
    (:mod:`torpor.bench.linkfloor`); every row of the table is also given as a multiple of it.
    """
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    data: dict[str, Any] = {}
    host = machine()
    d2h, h2d = floor()
    log(f"floor: pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s")
    engines = order(rounds, first)
    for i, backend in enumerate(engines):
        result = out / f"engine{i}-{backend}.json"
        env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER=os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"))
        if backend == "torpor":
            env["VLLM_PLUGINS"] = "torpor"
            env["TORPOR_LOG_DIR"] = tempfile.mkdtemp(prefix=f"torpor-bench{i}-")
            env["TORPOR_ENGINE"] = f"bench{i}"
        else:
            env["VLLM_PLUGINS"] = "none"  # vLLM's own backend with no plugin loaded: the baseline as users run it
        cmd = [sys.executable, "-m", "torpor.bench.vllm_engine", "--backend", backend, "--model", model]
        cmd += ["--json", str(result), "--mode", mode, "--cycles", str(cycles), "--l2-cycles", str(l2_cycles)]
        # every parameter's and buffer's checksum after each wake decides (outputs can flip with no tensor
        # changed at 8B: docs/vllm.md), and the baseline is a generation after a warm-up one
        cmd += ["--checksums", "--warmups", "1"]
        log(f"engine {i + 1}/{len(engines)}: {backend}")
        started = time.perf_counter()
        rc, left = run_engine(cmd, env, out / f"engine{i}-{backend}.log", timeout)
        res: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {"backend": backend, "ok": False}
        res.update(engine=i, rc=rc, wall_s=time.perf_counter() - started, left_behind=len(left))
        runs.append(res)
        ended = f", {len(left)} process(es) it left ended" if left else ""
        log(f"  rc {rc}, start {res.get('start_s', float('nan')):.1f} s, identical {res.get('identical')}{ended}")
        data = _save(
            out, runs, model=model, mode=mode, order=engines, cycles=cycles, l2_cycles=l2_cycles, machine=host,
            floor_d2h_Bps=d2h, floor_h2d_Bps=h2d,
        )  # fmt: skip
    return data


def run_engine(cmd: list[str], env: dict[str, str], log_path: Path, timeout: float) -> tuple[int | str, list[int]]:
    """Run one engine in a session of its own, then end every process still in it; its exit status and those pids.

    vLLM's engine core is a child process that can outlive an engine process
    which exits at once (``os._exit``), holding its share of the device: on the
    H200 the fourth engine of a run found 11 of 140 GiB free and could not
    start. So the next engine starts only once this one's process group is gone.
    """
    with log_path.open("w") as engine_log:
        proc = subprocess.Popen(cmd, env=env, stdout=engine_log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        left = end_group(proc.pid)
        proc.wait()
    return rc, [pid for pid in left if pid != proc.pid]


def group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that are alive (zombies hold no device memory), read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if state != "Z" and int(pgrp) == pgid:
            members.append(int(entry.name))
    return members


def end_group(pgid: int, grace: float = 15.0, kill_wait: float = 10.0) -> list[int]:
    """SIGTERM what is alive in group ``pgid``, SIGKILL what is left after ``grace`` s; the pids alive at first."""
    alive = group_members(pgid)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
        if not group_members(pgid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return alive


def _save(out: Path, runs: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
    """The results so far, summarized and written (after every engine: a run cut short keeps what it measured)."""
    data: dict[str, Any] = {**params, "engines_done": len(runs), "runs": runs}
    data["summary"] = summarize(runs)
    if "floor_d2h_Bps" in params:
        data["floor"] = against_floor(data["summary"], runs, params["floor_d2h_Bps"], params["floor_h2d_Bps"])
    (out / "vllm-bench.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "vllm-bench.md").write_text(markdown(data))
    return data


def machine() -> dict[str, Any]:
    """The GPU and software the run had (empty fields where unknown)."""
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["vllm"] = importlib.metadata.version("vllm")  # the package's metadata: importing vllm takes seconds
    return info


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per backend: the medians of every row of the table and of the later level-1 sleep's parts."""
    out: dict[str, dict[str, Any]] = {}
    for backend in BACKENDS:
        mine = [r for r in runs if r.get("backend") == backend and r.get("cycles")]
        l1 = [[c for c in r["cycles"] if c["level"] == 1] for r in mine]
        l2 = [c for r in mine for c in r["cycles"] if c["level"] == 2]
        later = [c for cs in l1 for c in cs[1:]]
        series = {
            "l1_sleep_first_s": [cs[0]["sleep_s"] for cs in l1 if cs],
            "l1_sleep_later_s": [c["sleep_s"] for c in later],
            "l1_wake_first_s": [cs[0]["wake_s"] for cs in l1 if cs],
            "l1_wake_later_s": [c["wake_s"] for c in later],
            "l2_sleep_s": [c["sleep_s"] for c in l2],
            "l2_wake_reload_s": [c["wake_s"] for c in l2],
        }
        row: dict[str, Any] = {
            "engines": len(mine),
            "ok": bool(mine) and all(r.get("ok") for r in mine),
            "start_s": [round(r["start_s"], 1) for r in mine],
            **{key: _median(values) for key, values in series.items()},
            "ranges": {key: [min(values), max(values)] if values else None for key, values in series.items()},
            "l2_reload_s": _median([c["reload_s"] for c in l2 if "reload_s" in c]),
            "freed_l1_gb": _median([c["freed"] / 1e9 for cs in l1 for c in cs]),
            "identical": bool(mine) and all(r.get("identical") for r in mine),
            "tensors_identical": _tensors_identical(mine),
        }
        parts: dict[str, list[float]] = {}
        for c in later:
            for key, seconds in c.get("worker", []):
                if key in ("worker.sleep", "backend.suspend"):
                    parts.setdefault(key, []).append(seconds)
        row["later_sleep_parts_s"] = {k: _median(v) for k, v in parts.items()}
        row["torpor_later_sleep_tags"] = _later_sleep_tags(mine) if backend == "torpor" else {}
        out[backend] = row
    return out


_TENSORS = {True: "identical", False: "CHANGED or failed", None: "not checked"}


def _tensors_identical(runs: list[dict[str, Any]]) -> bool | None:
    """True when every engine checked its tensors and none changed; False when one changed or failed (or none ran); else None."""
    if not runs:
        return False
    # an engine that failed before its cycles wrote no verdict: failed; one of before the checksums: not checked
    return all_of(r.get("tensors_identical", None if r.get("ok") else False) for r in runs)


def _later_sleep_tags(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """torpor's later level-1 sleeps (from the event logs): the median backup and release seconds per tag."""
    acc: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        sleeps = [p for p in r.get("torpor_phases", []) if p["op"] == "sleep" and p.get("level") == 1]
        for phase in sleeps[1:]:
            acc.setdefault("(total)", {}).setdefault("seconds", []).append(phase.get("seconds", 0.0))
            for tag, t in phase["tags"].items():
                for step in ("backup", "release"):
                    if step in t:
                        acc.setdefault(tag, {}).setdefault(step, []).append(t[step])
                acc.setdefault(tag, {}).setdefault("bytes", []).append(float(t.get("bytes", 0)))
    return {tag: {k: _median(v) for k, v in steps.items()} for tag, steps in acc.items()}


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


ROWS = {
    "l1_sleep_first_s": "L1 sleep, first",
    "l1_sleep_later_s": "L1 sleep, later",
    "l1_wake_first_s": "L1 wake, first",
    "l1_wake_later_s": "L1 wake, later",
    "l2_sleep_s": "L2 sleep",
    "l2_wake_reload_s": "L2 wake + reload",
}


def verdict(a: list[float] | None, b: list[float] | None, names: tuple[str, str] = BACKENDS) -> str:
    """Which backend's single cycles all beat the other's (ranges apart), else that this run cannot tell them apart."""
    if not a or not b:
        return "n/a"
    if a[1] < b[0]:
        return f"`{names[0]}` faster"
    if b[1] < a[0]:
        return f"`{names[1]}` faster"
    return "overlap: not told apart"


def spread(summary: dict[str, dict[str, Any]]) -> list[str]:
    """The table of each row's single cycles, min-max per backend, and whether the ranges are apart."""
    a, b = BACKENDS
    lines = ["", "Single cycles, min-max (a row whose ranges overlap is a tie in this run):", ""]
    lines += [f"| row | `{a}` | `{b}` | ranges |", "| --- | --- | --- | --- |"]
    for key, name in ROWS.items():
        ra, rb = summary[a]["ranges"][key], summary[b]["ranges"][key]
        cells = ["n/a" if r is None else f"{r[0]:.3f}-{r[1]:.3f} s" for r in (ra, rb)]
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {verdict(ra, rb)} |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    """The comparison table, the parts of a later level-1 sleep, and torpor's per-tag figures."""
    s = data["summary"]
    m = data.get("machine", {})
    lines = [
        f"Model `{Path(data['model']).name}`, mode {data['mode']}, engines in the order {', '.join(data['order'])}, "
        f"{data['cycles']} level-1 and {data['l2_cycles']} level-2 cycles each; "
        f"{m.get('gpu', '?')}, torch {m.get('torch', '?')}, vLLM {m.get('vllm', '?')}. Medians.",
        "",
        "| backend | L1 sleep first / later | L1 wake first / later | L2 sleep | L2 wake + reload | freed (L1) "
        "| engine start | tensors after every wake | outputs after every wake |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in BACKENDS:
        r = s[b]
        freed = "n/a" if r["freed_l1_gb"] is None else f"{r['freed_l1_gb']:.1f} GB"
        lines.append(
            f"| `{b}` | {_s(r['l1_sleep_first_s'])} / {_s(r['l1_sleep_later_s'])} | {_s(r['l1_wake_first_s'])} / "
            f"{_s(r['l1_wake_later_s'])} | {_s(r['l2_sleep_s'])} | {_s(r['l2_wake_reload_s'])} | {freed} | "
            f"{', '.join(f'{x:.1f} s' for x in r['start_s'])} | "
            f"{_TENSORS[r.get('tensors_identical')]} | "
            f"{'identical' if r['identical'] else 'DIFFERENT or failed'} |"
        )
    lines += spread(s)
    lines += floor_lines(data, ROWS)
    tags = s["torpor"]["torpor_later_sleep_tags"]
    lines += ["", "Where a later level-1 sleep goes (medians):", ""]
    lines += [
        "| backend | `LLM.sleep` | worker `sleep` | backend `suspend` | torpor's own sleep (event log) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for b in BACKENDS:
        r, p = s[b], s[b]["later_sleep_parts_s"]
        own = _s(tags.get("(total)", {}).get("seconds")) if b == "torpor" else "-"
        lines.append(
            f"| `{b}` | {_s(r['l1_sleep_later_s'])} | {_s(p.get('worker.sleep'))} | "
            f"{_s(p.get('backend.suspend'))} | {own} |"
        )
    if tags:
        lines += ["", "torpor's later level-1 sleep per tag (event log, medians):", ""]
        # one backup call copies every offloaded tag: its seconds are the call's, the same on each of them
        lines += ["| tag | bytes | backup (the one call) | release |", "| --- | --- | --- | --- |"]
        for tag, t in sorted(tags.items()):
            if tag == "(total)":
                continue
            size = "" if t.get("bytes") is None else f"{t['bytes'] / 1e6:,.0f} MB"
            lines.append(f"| {tag} | {size} | {_s(t.get('backup'))} | {_s(t.get('release'))} |")
    profiled: set[str] = set()
    for run in data.get("runs", []):
        sleep = (run.get("profile") or {}).get("sleep")
        if not sleep or run.get("backend") in profiled:
            continue
        profiled.add(run["backend"])
        lines += ["", f"`{run['backend']}`: one more level-1 sleep under cProfile in the worker"]
        lines[-1] += f" ({sleep['seconds']:.3f} s with the profiler on), by own time:"
        lines += ["", "| function | calls | own | with callees |", "| --- | --- | --- | --- |"]
        lines += [f"| `{t['func']}` | {t['calls']} | {_s(t['tottime'])} | {_s(t['cum'])} |" for t in sleep["top"][:8]]
    return "\n".join(lines) + "\n"
