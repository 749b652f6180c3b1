"""One vLLM engine of the backend comparison, in its own process: start, sleep/wake cycles, where the time went.

``python -m torpor.bench.vllm_engine --backend cumem|torpor --model DIR --json FILE``
starts a ``vllm.LLM`` with sleep mode on that backend and graphs offloaded,
times the engine start, then runs level-1 cycles (the first is the cold one)
and level-2 cycles (wake weights, ``reload_weights``, wake kv_cache). Each
cycle records the caller's wall time, the device memory freed, and, from
timers put into the worker (``collective_rpc``), the worker's ``sleep`` /
``wake_up`` and the backend's ``suspend`` / ``resume``: what lies between is
vLLM's engine core and IPC, and the worker's own synchronize and memory
queries. The last cycle runs under cProfile in the worker (its figures are not
in the timing rows). After every wake the checksums of every parameter and buffer
on the device are compared with the ones before the first sleep, and the greedy
outputs with a baseline generated after a warm-up generation: vLLM's first
generation after a cold compile can differ from later ones with every tensor
unchanged (docs/vllm.md, "Exactness of the first cold sleep").

The driver is :mod:`torpor.bench.vllm`; one engine per process because vLLM's
``cumem`` allocator and torpor's cannot share one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torpor.bench.checksums import module_checksums
from torpor.statemachine import read_events
from torpor.statemachine.core.events import EventKind
from torpor.switches import env_path

PROMPTS = ["Hello, how are you today?", "The capital of France is", "def add(a, b):", "Once upon a time"]
#: Full CUDA graphs of decode without torch.compile (a shorter start), as the vLLM kit's llm_smoke.py runs them.
GRAPHS_MODE: dict[str, Any] = {
    "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "custom_ops": ["none"]},
    "kernel_config": {"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}},
    "attention_config": {"backend": "TRITON_ATTN"},
}
TIMED = (("worker", ("sleep", "wake_up")), ("backend", ("suspend", "resume")))


def install_timers(wrapper: Any) -> str:
    """In the worker: wrap ``sleep``/``wake_up`` and the backend's ``suspend``/``resume`` with timers."""
    worker = getattr(wrapper, "worker", wrapper)
    record: list[tuple[str, float]] = []
    worker._torpor_bench_times = record
    owners = {
        "worker": worker,
        "backend": worker.sleep_mode_backend,
    }  # creates the backend now, as the first sleep would
    for owner, names in TIMED:
        target = owners[owner]
        for name in names:
            inner = getattr(target, name)

            def timed(*args: Any, _inner: Any = inner, _key: str = f"{owner}.{name}", **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    record.append((_key, time.perf_counter() - start))

            setattr(target, name, timed)
    return type(owners["backend"]).__name__


def model_checksums(wrapper: Any) -> dict[str, str]:
    """In the worker: ``dtype:shape:sum:weighted`` of every parameter and buffer of the model, by name (torpor.bench.checksums)."""
    worker = getattr(wrapper, "worker", wrapper)
    model = worker.model_runner.model
    tensors = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    return {
        name: f"{tensors[name].dtype}:{tuple(tensors[name].shape)}:{plain:x}:{weighted:x}"
        for name, (plain, weighted) in module_checksums(model).items()
    }


def model_bytes(wrapper: Any) -> dict[str, int]:
    """In the worker: the device bytes of the model's parameters and of its buffers (a tensor shared by two names once)."""
    worker = getattr(wrapper, "worker", wrapper)
    model = worker.model_runner.model
    seen: set[int] = set()
    sizes = {"parameters": 0, "buffers": 0}
    for kind, tensors in (("parameters", model.parameters()), ("buffers", model.buffers())):
        for tensor in tensors:
            if tensor.is_cuda and tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                sizes[kind] += tensor.numel() * tensor.element_size()
    return sizes


def take_times(wrapper: Any) -> list[tuple[str, float]]:
    """In the worker: the timings recorded since the last call, cleared."""
    worker = getattr(wrapper, "worker", wrapper)
    record: list[tuple[str, float]] = worker._torpor_bench_times
    out = list(record)
    record.clear()
    return out


def profiled_cycle(wrapper: Any, level: int, top: int = 30) -> dict[str, Any]:
    """In the worker: one sleep and one full wake under cProfile; the functions that took the most time, per step."""
    import cProfile
    import io
    import pstats

    worker = getattr(wrapper, "worker", wrapper)
    out: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("sleep", lambda: worker.sleep(level)),
        ("wake", lambda: worker.wake_up(None)),
    ]
    for step, call in steps:
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        call()
        prof.disable()
        seconds = time.perf_counter() - start
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(top)
        rows = []
        for (file, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            rows.append(
                {"func": f"{Path(file).name}:{line}:{func}", "calls": calls, "tottime": tottime, "cum": cumtime}
            )
        rows.sort(key=lambda r: -r["tottime"])
        out[step] = {"seconds": seconds, "top": rows[:top], "text": text.getvalue()[-6000:]}
    take_times(wrapper)  # the profiled cycle's timers are not timing rows
    return out


def engine_kwargs(model: str, backend: str, mode: str, gpu_mem: float) -> dict[str, Any]:
    """vllm.LLM's arguments: the tests' engine settings, sleep mode on ``backend``, graphs offloaded."""
    kwargs: dict[str, Any] = {
        "model": model,
        "max_model_len": 1024,
        "gpu_memory_utilization": gpu_mem,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 2048,
        "enable_prefix_caching": False,
        "seed": 0,
        "enable_sleep_mode": True,
        "sleep_mode_backend": backend,
        "sleep_mode_offload_cudagraph": True,
    }
    if mode == "eager":
        kwargs["enforce_eager"] = True
    elif mode == "graphs":
        kwargs.update(GRAPHS_MODE)
    return kwargs


def torpor_phases(log_dir: Path) -> list[dict[str, Any]]:
    """Per sleep and wake in torpor's rank-0 log: seconds, and per tag the backup, release and restore seconds."""
    logs = sorted(log_dir.glob("*.rank0.jsonl"))
    if not logs:
        return []
    out: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    for event in read_events(logs[0]):
        d = event.data
        if event.kind in (EventKind.SLEEP_REQUESTED, EventKind.WAKE_REQUESTED):
            current = {"op": "sleep" if event.kind is EventKind.SLEEP_REQUESTED else "wake", "tags": {}}
        elif event.kind in (EventKind.TAG_BACKED_UP, EventKind.TAG_RELEASED, EventKind.TAG_RESTORED) and current:
            step = {EventKind.TAG_BACKED_UP: "backup", EventKind.TAG_RELEASED: "release"}.get(event.kind, "restore")
            tag = current["tags"].setdefault(d.get("tag"), {"bytes": int(d.get("bytes", 0))})
            tag[step] = float(d.get("seconds", 0.0))
        elif event.kind in (EventKind.SLEEP_COMPLETED, EventKind.WAKE_COMPLETED) and current:
            current["seconds"] = float(d.get("seconds", 0.0))
            if event.kind is EventKind.SLEEP_COMPLETED:
                current["level"] = d.get("level")
            else:
                current["wake_tags"] = d.get("tags")
            out.append(current)
            current = {}
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, run the cycles; the result (also when a check failed: ``ok`` false, ``error``)."""
    from vllm import LLM, SamplingParams

    res: dict[str, Any] = {"backend": a.backend, "model": a.model, "mode": a.mode, "cycles": []}
    start = time.perf_counter()
    kwargs = engine_kwargs(a.model, a.backend, a.mode, a.gpu_mem)
    if a.load_format:
        kwargs["load_format"] = a.load_format
    llm = LLM(**kwargs)
    res["start_s"] = time.perf_counter() - start
    import torch  # after the engine is up: a CUDA context here must not precede its start

    # by reference (this module, importable in the worker), not by value as a function of __main__ would go
    here = importlib.import_module("torpor.bench.vllm_engine")

    res["backend_class"] = llm.collective_rpc(here.install_timers)[0]
    res["model_bytes"] = llm.collective_rpc(here.model_bytes)[0]  # what each step moves, for the floor
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # random weights may pick EOS early

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sampling, use_tqdm=False)]

    checksums = a.checksums

    def sums() -> dict[str, str]:
        return llm.collective_rpc(here.model_checksums)[0] if checksums else {}

    res["warmups"] = [generate() for _ in range(a.warmups)]  # the first generations, kept as tokens
    baseline = generate()
    res["baseline"] = baseline
    res["warmups_equal_baseline"] = [w == baseline for w in res["warmups"]]
    before = sums()
    res["checksums_before"] = before
    res["identical"] = True
    plan = [1] * a.cycles + [2] * a.l2_cycles
    for i, level in enumerate(plan):
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        llm.sleep(level=level)
        sleep_s = time.perf_counter() - t
        freed = torch.cuda.mem_get_info()[0] - free_before
        t = time.perf_counter()
        if level == 1:
            llm.wake_up()
            wake = {"wake_s": time.perf_counter() - t}
        else:
            llm.wake_up(tags=["weights"])
            w = time.perf_counter()
            llm.collective_rpc("reload_weights")
            r = time.perf_counter()
            llm.wake_up(tags=["kv_cache"])
            wake = {"wake_s": time.perf_counter() - t, "wake_weights_s": w - t, "reload_s": r - w}
        tokens = generate()
        same = tokens == baseline
        res["identical"] = res["identical"] and same
        cycle: dict[str, Any] = {"level": level, "index": i, "sleep_s": sleep_s, "freed": freed, "same": same, **wake}
        if res["warmups"]:
            cycle["same_as_first"] = tokens == res["warmups"][0]
        if checksums:
            after = sums()
            cycle["tensors_changed"] = sorted(n for n in before if after.get(n) != before[n])
            cycle["tensors_checked"] = len(before)
            if not same:
                cycle["tokens"] = tokens
        cycle["worker"] = llm.collective_rpc(here.take_times)[0]
        res["cycles"].append(cycle)
        changed = f", {len(cycle['tensors_changed'])} of {len(before)} tensors changed" if checksums else ""
        a.log(
            f"{a.backend} cycle {i}: L{level} sleep {sleep_s:.3f} s freed {freed / 1e9:.1f} GB wake {wake['wake_s']:.3f} s {'same' if same else 'DIFFERENT'}{changed}"
        )
    log_dir = env_path("TORPOR_LOG_DIR")
    if a.backend == "torpor" and log_dir is not None:  # before the profiled cycle: timing rows only
        res["torpor_phases"] = torpor_phases(log_dir)
    if a.profile:
        res["profile"] = llm.collective_rpc(here.profiled_cycle, args=(1,))[0]
        res["identical_after_profile"] = generate() == baseline
    res["tensors_identical"] = tensor_verdict(res["cycles"])
    # the tensors decide: at 8B vLLM's greedy outputs can flip between generations with no tensor changed
    # (docs/vllm.md, "Exactness of the first cold sleep"); without checksums the outputs are all there is
    res["ok"] = bool(res["tensors_identical"]) if checksums else bool(res["identical"])
    return res


def all_of(verdicts: Iterable[bool | None]) -> bool | None:
    """False when one verdict is False, True when there are some and all are True, else None (not checked)."""
    seen = list(verdicts)
    if False in seen:
        return False
    return True if seen and all(seen) else None


def tensor_verdict(cycles: list[dict[str, Any]]) -> bool | None:
    """Whether every cycle's checksums found no tensor changed; None when a cycle was not checked (never 'identical' unchecked)."""
    return all_of(not c["tensors_changed"] if "tensors_changed" in c else None for c in cycles)


def main(argv: list[str] | None = None) -> int:
    """Run one engine; write its JSON; exit 0 when every output was identical."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["cumem", "torpor"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--mode", choices=["compile", "graphs", "eager"], default="compile")
    p.add_argument("--cycles", type=int, default=4, help="level-1 cycles (default 4)")
    p.add_argument("--l2-cycles", type=int, default=2, help="level-2 cycles (default 2)")
    p.add_argument("--gpu-mem", type=float, default=0.3)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--warmups", type=int, default=0, help="generations before the baseline, kept as tokens")
    p.add_argument(
        "--checksums", action="store_true", help="checksum every parameter and buffer before and after each cycle"
    )
    p.add_argument("--load-format", default=None, help="vLLM's load_format (dummy: random weights of the config)")
    a = p.parse_args(argv)
    a.log = lambda s: (sys.stderr.write(s + "\n"), sys.stderr.flush())
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the timers are functions sent to the worker
    try:
        res = run(a)
    except Exception as exc:  # the driver reads the reason from the JSON
        res = {"backend": a.backend, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    a.json.write_text(json.dumps(res, default=str))
    sys.stderr.flush()
    # a normal exit can wait on the engine's processes; the driver (torpor.bench.vllm.run_engine) ends what is left
    os._exit(0 if res.get("ok") else 1)


if __name__ == "__main__":
    sys.exit(main())
