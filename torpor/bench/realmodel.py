"""The real-model rows of ``torpor bench``: a Qwen3-1.7B-shaped transformers model, its graph and a KV block, on four systems.

The model is built offline from a config (random bf16 weights, fixed seed; no
download), a full 1 x 256 forward is captured as a CUDA graph and a 2 GiB
block stands for the KV cache. torpor puts the weights in the ``weights`` tag,
the graph in its graph pool (offloaded with it) and the block in ``kv_cache``
(discarded at level 1); torch_memory_saver, and torpor through its
torch_memory_saver API (:mod:`torpor.tms`), get the weights in a region with
a backup (pinned, mmap or disk: :mod:`torpor.bench.tmsbackends`, one pair of
rows each) and the block in one without; the vLLM-style loop gets one
allocation per weight tensor (copied) and one for the block (dropped). Only
torpor offloads the graph's memory: the others capture into torch's own pool,
which stays on the device. Every row's floor is its own bytes copied.

The builders are shared with the GPU tests (tests/test_models_gpu.py). torch
and transformers are imported when a function runs.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torpor.allocator import TaggedAllocator
from torpor.bench.device import free_device, measure_floor, run_record, tensor_at
from torpor.bench.report import row_line
from torpor.bench.result import Result
from torpor.bench.systems import VllmStyle, timed_sleep_wake, torch_mode_saver
from torpor.bench.tmsbackends import TMS_BACKENDS, HostWatch, backup_dir, check_backends, row_name, weights_region
from torpor.bench.tmsbackends import disk_parent as tms_disk_parent
from torpor.statemachine.machine.controller import SleepController
from torpor.units import GiB, MiB

#: A Qwen3-1.7B shape: 28 layers, hidden 2048, tied embeddings (1.7 B parameters, 3.4 GB in bf16).
DENSE: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
#: A small Qwen3-MoE shape: 8 layers of 16 experts, 2 per token (batched_mm experts: no host sync, capturable).
MOE: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "use_sliding_window": False,
}
SEQ = 256
KV_BYTES = 2 * GiB
WORKLOAD = "real model: Qwen3-1.7B shape (bf16) + 1x256 graph + 2 GiB KV"


def config(kind: str = "dense", **overrides: Any) -> Any:
    """The transformers config of the ``dense`` (Qwen3) or ``moe`` (Qwen3-MoE) shape, with ``overrides``."""
    import transformers

    if kind == "dense":
        return transformers.Qwen3Config(**{**DENSE, **overrides})
    cfg = transformers.Qwen3MoeConfig(**{**MOE, **overrides})
    cfg._experts_implementation = "batched_mm"  # the eager experts loop calls nonzero(): a host sync, not capturable
    return cfg


def build(cfg: Any, device: str = "cuda", seed: int = 0) -> Any:
    """A causal LM from ``cfg`` on ``device``: random bf16 weights (seed ``seed``), eval mode, sdpa attention."""
    import torch
    import transformers

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    return model.eval()


def prompt(cfg: Any, n: int = SEQ, device: str = "cuda", seed: int = 1) -> Any:
    """``1 x n`` token ids (seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (1, n), generator=g).to(device)


def forward(model: Any, ids: Any) -> Any:
    """The full forward's logits, no cache."""
    return model(input_ids=ids, use_cache=False).logits


def capture(
    model: Any, ids: Any, ctl: SleepController | None = None, site: str = "model.forward 1x256"
) -> tuple[Any, Any]:
    """Warm up, then capture ``forward`` as a graph (into torpor's graph pool through ``ctl``, else torch's); (graph, out)."""
    import torch

    with torch.no_grad():
        s = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                forward(model, ids)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        if ctl is not None:
            with ctl.capture(site) as cap, cap.graph(g):  # type: ignore[attr-defined]
                out = forward(model, ids)
        else:
            with torch.cuda.graph(g):
                out = forward(model, ids)
    g.replay()
    torch.cuda.synchronize()
    return g, out


def replay_equal(graph: Any, out: Any, ref: Any) -> bool:
    """Replay after zeroing the output; bit-exact against ``ref``."""
    import torch

    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out, ref))


def _finish(res: Result) -> Result:
    gc.collect()
    import torch

    torch.cuda.empty_cache()
    return res


def run_torpor_model(cycles: int) -> Result:
    """torpor: weights, the graph pool and the KV block tagged; level 1 sleeps right after loading (a cold first sleep)."""
    import torch

    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    t0 = time.perf_counter()
    cfg = config()
    with alloc.use_memory_pool("weights"):
        model = build(cfg)
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.empty(KV_BYTES, dtype=torch.uint8, device="cuda")
    with alloc.use_memory_pool("runtime"):
        ids = prompt(cfg)
    graph, out = capture(model, ids, ctl)
    ref = out.clone()
    usage = alloc.usage()
    moved = sum(u.resident for t, u in usage.items() if t != "kv_cache")
    res = Result("torpor", WORKLOAD, moved, sum(u.allocations for u in usage.values()))
    res.prepare_s = time.perf_counter() - t0
    res.note = (
        f"weights {usage['weights'].resident / GiB:.2f} GiB + graph pool {usage['cudagraph'].resident / MiB:.0f} MiB "
        f"copied, KV {usage['kv_cache'].resident / GiB:.0f} GiB discarded; no wait for pin-ahead"
    )
    for _ in range(cycles):
        timed_sleep_wake(ctl, alloc, res)
        res.exact = res.exact and replay_equal(graph, out, ref)
    del model, kv, ids, graph, out, ref
    return _finish(res)


class VllmStyleBlock(VllmStyle):
    """The vLLM-style loop for a discarded tag: sleep unmaps without copying, wake maps fresh memory."""

    def sleep(self) -> None:
        """Unmap and release every allocation (its content is gone)."""
        for a in self.allocs:
            self._ok(self.cu.cuMemUnmap(a[0], a[1]))
            self._ok(self.cu.cuMemRelease(a[2]))

    def wake(self) -> None:
        """Map fresh memory at each allocation's address."""
        for a in self.allocs:
            a[2] = self._map(a[0], a[1])


def _move_into(base: VllmStyle, model: Any) -> int:
    """Give every parameter and buffer of ``model`` its own allocation of ``base`` (tied tensors once); bytes mapped."""
    import torch

    total = 0

    def moved(t: Any) -> Any:
        nonlocal total
        size = -(-t.nbytes // (2 * MiB)) * (2 * MiB)
        view = tensor_at(base.allocate(size), t.nbytes).view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        total += size
        return view

    for p in model.parameters():  # each tied parameter once
        p.data = moved(p)
    for name, b in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = moved(b)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()  # torch's copies of the weights go back
    return total


def run_baseline_model(cycles: int) -> Result:
    """The vLLM-style loop: one allocation per weight tensor (synchronous copies), one KV allocation dropped."""
    import torch

    t0 = time.perf_counter()
    cfg = config()
    model = build(cfg)
    base, block = VllmStyle(), VllmStyleBlock()
    moved = _move_into(base, model)
    ptr = block.allocate(KV_BYTES)
    tensor_at(ptr, KV_BYTES).zero_()
    ids = prompt(cfg)
    graph, out = capture(model, ids)
    ref = out.clone()
    res = Result("vllm-style", WORKLOAD, moved, len(base.allocs) + 1, prepare_s=time.perf_counter() - t0)
    res.note = "one allocation per weight tensor; the graph in torch's pool stays on the device"
    for _ in range(cycles):
        before = free_device()
        t = time.perf_counter()
        base.sleep()
        block.sleep()
        res.sleeps.append(time.perf_counter() - t)
        res.released.append(free_device() - before)
        res.host_held = moved
        t = time.perf_counter()
        base.wake()
        block.wake()
        torch.cuda.synchronize()
        res.wakes.append(time.perf_counter() - t)
        res.exact = res.exact and replay_equal(graph, out, ref)
    del graph, out, ref, model, ids
    gc.collect()
    base.close()
    block.close()
    torch._C._host_emptyCache()
    return _finish(res)


def kv_block() -> Any:
    """The 2 GiB block standing for the KV cache, on the device (uninitialised)."""
    import torch

    return torch.empty(KV_BYTES, dtype=torch.uint8, device="cuda")


def run_tms_model(
    cycles: int, system: str = "torch_memory_saver", backend: str = "pinned", disk_parent: Path | None = None
) -> Result:
    """A torch_memory_saver API (hook_mode torch): the weights in a region backed up on ``backend``, the KV block in one without.

    ``system``: ``"torch_memory_saver"`` (the package itself) or ``"torpor.tms"`` (torpor's
    implementation of the same API, :mod:`torpor.tms`): the same calls in the same order.
    ``backend``: ``pinned`` or ``mmap`` (``enable_cpu_backup=True, cpu_backup_backend=backend``) or
    ``disk`` (``enable_disk_backup=True`` into a fresh directory under ``disk_parent``, removed after);
    the weights' tag is the backend's (:func:`~torpor.bench.tmsbackends.weights_region`; why: that module's docstring);
    the row is :func:`~torpor.bench.tmsbackends.row_name`. Host memory: :class:`~torpor.bench.tmsbackends.HostWatch`.
    """
    import torch

    weights = weights_region(backend)  # an unknown backend is refused before anything runs
    res = Result(row_name(system, backend), WORKLOAD, 0, 0)
    try:
        tms = torch_mode_saver(system)
    except Exception as exc:  # not installed: reported, not fatal
        res.note = f"not importable ({type(exc).__name__}: {exc})"
        res.exact = False
        return res
    with backup_dir(tms, backend, disk_parent) as disk:
        t0 = time.perf_counter()
        cfg = config()
        with tms.region(**weights):
            model = build(cfg)
        with tms.region(tag="kv_cache", enable_cpu_backup=False):
            kv = kv_block()
        ids = prompt(cfg)
        graph, out = capture(model, ids)
        ref = out.clone()
        res.nbytes = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
        res.prepare_s = time.perf_counter() - t0
        host = HostWatch(disk)
        for _ in range(cycles):
            before = free_device()
            host.before_pause()
            t = time.perf_counter()
            tms.pause(weights["tag"])
            tms.pause("kv_cache")
            torch.cuda.synchronize()
            res.sleeps.append(time.perf_counter() - t)
            res.released.append(free_device() - before)
            host.while_paused()
            t = time.perf_counter()
            tms.resume(weights["tag"])
            tms.resume("kv_cache")
            torch.cuda.synchronize()
            res.wakes.append(time.perf_counter() - t)
            host.after_resume()
            res.exact = res.exact and replay_equal(graph, out, ref)
        res.host_held = host.held()
        res.note = f"the graph in torch's pool stays on the device; {host.note()}"
        del model, kv, ids, graph, out, ref
        gc.collect()
        torch.cuda.empty_cache()
    return _finish(res)


def run_real_model(
    cycles: int = 4, tms: bool = True, backends: Sequence[str] = TMS_BACKENDS, disk_parent: Path | None = None
) -> list[Result]:
    """The real-model rows: torpor, the vLLM-style loop, then per backend torpor.tms and (when ``tms``) torch_memory_saver.

    The backends and the disk folder are checked before the first row runs (refused: nothing runs).
    """
    backends = check_backends(backends)
    if "disk" in backends:
        disk_parent = tms_disk_parent(disk_parent)
    out = [run_torpor_model(cycles), run_baseline_model(cycles)]
    for backend in backends:
        out.append(run_tms_model(cycles, "torpor.tms", backend, disk_parent))
        if tms:
            out.append(run_tms_model(min(cycles, 3), "torch_memory_saver", backend, disk_parent))
    return out


def report(
    cycles: int = 4,
    tms: bool = True,
    log: Callable[[str], None] = print,
    backends: Sequence[str] = TMS_BACKENDS,
    disk_parent: Path | None = None,
) -> dict[str, Any]:
    """Only the real-model rows (``torpor bench --real-model``), with the floor measured first, JSON-ready."""
    backends = check_backends(backends)
    if "disk" in backends:
        disk_parent = tms_disk_parent(disk_parent)
    d2h, h2d = measure_floor()
    log(f"floor: pinned D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s")
    results = run_real_model(cycles, tms, backends, disk_parent)
    data = run_record(results, d2h, h2d, cycles)
    for row in data["rows"]:
        log(row_line(row))
    return data
