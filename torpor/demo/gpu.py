"""The demo's workload on a CUDA GPU: a small transformer-like decoder with weights, a kv_cache and CUDA graphs.

Every tensor lives in a pool of the tagged allocator: ``weights`` (embedding
and 8 layers, about 0.9 GiB of bf16), ``kv_cache`` (2 GiB), ``runtime`` (the
graphs' static inputs and a workspace) and, for each batch size, one CUDA
graph captured into the ``cudagraph`` pool through ``SleepController.capture``.
The first awake run's outputs are the reference: after every wake the graphs
are replayed (no recapture) and their outputs compared bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torpor.allocator import TaggedAllocator
from torpor.demo.workload import BATCH_SIZES, Check
from torpor.statemachine import Memory, SleepController

HIDDEN = 2048
LAYERS = 8
HEADS = 16
VOCAB = 32000
CONTEXT = 256  # kv slots each decoded sequence attends to
KV_SLOTS = 32768  # slots per layer in the kv_cache (2 GiB in all)
WORKSPACE = 64 << 20


class GpuWorkload:
    """The decoder on ``cuda:0`` over ``torpor.allocator.TaggedAllocator()``."""

    device = "cuda"
    untagged = "CUDA context, cuBLAS/NCCL, torch's default pool"

    def __init__(self, seed: int = 0) -> None:
        import torch

        self.torch: Any = torch
        self.seed = seed
        self.allocator = TaggedAllocator()
        self.weights: dict[str, Any] = {}
        self.checkpoint: dict[str, Any] = {}
        self.kv: Any = None
        self.inputs: dict[int, Any] = {}
        self.workspace: Any = None
        self.graphs: dict[int, tuple[Any, Any]] = {}
        self.reference: dict[int, Any] = {}

    @property
    def memory(self) -> Memory:
        """The tagged cuMem allocator."""
        return self.allocator  # type: ignore[no-any-return]

    def describe(self) -> list[str]:
        """What runs where."""
        name = self.torch.cuda.get_device_name(0)
        return [
            f"device     cuda:0 ({name}), torch {self.torch.__version__}",
            f"workload   decoder, hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}, bf16 weights; "
            f"kv_cache of {KV_SLOTS} slots per layer",
            f"graphs     one CUDA graph per batch size {', '.join(map(str, BATCH_SIZES))}, "
            "captured into the cudagraph pool, replayed after every wake without recapture",
            "check      graph outputs bit-exact (torch.equal) vs the first awake run; weights vs their checkpoint",
        ]

    # -- the model ---------------------------------------------------------------------

    def _forward(self, tokens: Any) -> Any:
        torch = self.torch
        f = torch.nn.functional
        w = self.weights
        batch = tokens.shape[0]
        head_dim = HIDDEN // HEADS
        x = f.embedding(tokens, w["embed"])
        for layer in range(LAYERS):
            p = f"layer{layer}."
            h = f.rms_norm(x, (HIDDEN,), w[p + "norm1"])
            qkv = h @ w[p + "wqkv"]
            q = (qkv[:, :HIDDEN] + qkv[:, HIDDEN : 2 * HIDDEN] + qkv[:, 2 * HIDDEN :]).view(batch, HEADS, head_dim)
            k = self.kv[layer, 0, : 32 * CONTEXT].view(32, CONTEXT, HEADS, head_dim)[:batch]
            v = self.kv[layer, 1, : 32 * CONTEXT].view(32, CONTEXT, HEADS, head_dim)[:batch]
            scores = torch.einsum("bhd,bchd->bhc", q, k) * head_dim**-0.5
            attn = torch.einsum("bhc,bchd->bhd", scores.softmax(-1), v).reshape(batch, HIDDEN)
            x = x + attn @ w[p + "wo"]
            h = f.rms_norm(x, (HIDDEN,), w[p + "norm2"])
            x = x + f.gelu(h @ w[p + "w1"]) @ w[p + "w2"]
        return f.rms_norm(x, (HIDDEN,), w["norm_f"]) @ w["embed"].T

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {"embed": (VOCAB, HIDDEN), "norm_f": (HIDDEN,)}
        for layer in range(LAYERS):
            p = f"layer{layer}."
            shapes |= {
                p + "norm1": (HIDDEN,),
                p + "wqkv": (HIDDEN, 3 * HIDDEN),
                p + "wo": (HIDDEN, HIDDEN),
                p + "norm2": (HIDDEN,),
                p + "w1": (HIDDEN, 4 * HIDDEN),
                p + "w2": (4 * HIDDEN, HIDDEN),
            }
        return shapes

    def setup(self, controller: SleepController) -> None:
        """Load weights (keeping a host checkpoint), prefill the kv_cache, capture and run every graph."""
        torch = self.torch
        dev = torch.device("cuda", 0)
        gen = torch.Generator(device=dev).manual_seed(self.seed)
        with self.allocator.use_memory_pool("weights"):
            for name, shape in self._shapes().items():
                t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
                if name.endswith(("norm1", "norm2", "norm_f")):
                    t.fill_(1.0)
                else:
                    t.normal_(0.0, 0.02, generator=gen)
                self.weights[name] = t
        self.checkpoint = {n: t.cpu() for n, t in self.weights.items()}
        with self.allocator.use_memory_pool("kv_cache"):
            self.kv = torch.empty((LAYERS, 2, KV_SLOTS, HIDDEN), dtype=torch.bfloat16, device=dev)
        self._prefill()
        controller.observe()  # the timeline shows weights and kv_cache before the graphs
        with self.allocator.use_memory_pool("runtime"):
            self.workspace = torch.zeros(WORKSPACE, dtype=torch.uint8, device=dev)
            for batch in BATCH_SIZES:
                self.inputs[batch] = (torch.arange(batch, device=dev) * 7919 + 11) % VOCAB
        side = torch.cuda.Stream()
        for batch in BATCH_SIZES:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(self.inputs[batch])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with controller.capture(f"decode batch={batch}") as handle:
                # handle.graph records the graph so the pool can name it as a holder; thread_local: the
                # allocator's pinning thread may call the driver while this thread captures
                mode = "thread_local"
                if hasattr(handle, "graph"):
                    ctx = handle.graph(graph, capture_error_mode=mode)
                else:
                    ctx = torch.cuda.graph(graph, pool=handle, capture_error_mode=mode)
                with ctx:
                    out = self._forward(self.inputs[batch])
            self.graphs[batch] = (graph, out)
        self.reference = self._run()
        controller.observe()

    def _prefill(self) -> None:
        """Recompute the kv_cache (deterministically, as a prefill of the same prompts would)."""
        gen = self.torch.Generator(device=self.kv.device).manual_seed(self.seed + 1)
        self.kv.normal_(0.0, 1.0, generator=gen)

    def _run(self) -> dict[int, Any]:
        outs = {}
        for batch, (graph, out) in self.graphs.items():
            graph.replay()
            outs[batch] = out.cpu()
        self.torch.cuda.synchronize()
        return outs

    # -- after a wake ------------------------------------------------------------------

    def prepare(self, woken: Sequence[str], reload_weights: bool) -> None:
        """Reload weights from the host checkpoint (level 2), then prefill the kv_cache if it woke."""
        if reload_weights and "weights" in woken:
            for name, t in self.weights.items():
                t.copy_(self.checkpoint[name], non_blocking=False)
        if "kv_cache" in woken:
            self._prefill()
        self.torch.cuda.synchronize()

    def _weights_equal(self) -> bool:
        return all(self.torch.equal(t.cpu(), self.checkpoint[n]) for n, t in self.weights.items())

    def check(self, tags: Sequence[str], refilled: Sequence[str], reloaded: Sequence[str]) -> Check:
        """Weights vs checkpoint while kv_cache sleeps; graph outputs vs the reference once all is awake."""

        def label(tag: str) -> str:
            return "reloaded" if tag in reloaded else "refilled" if tag in refilled else "exact"

        if "kv_cache" not in tags:
            same = self._weights_equal()
            per_tag = {"weights": label("weights") if same else "DIFFERS"}
            return Check(same, f"{len(self.weights)} weight tensors equal their checkpoint", per_tag)
        outs = self._run()
        same = all(self.torch.equal(outs[b], self.reference[b]) for b in self.graphs)
        if same:
            per_tag = {t: label(t) for t in tags}
            return Check(True, f"outputs of {len(self.graphs)} replayed graphs bit-exact vs the first run", per_tag)
        per_tag = {t: "outputs differ" for t in tags}
        if not self._weights_equal():
            per_tag["weights"] = "DIFFERS"
        return Check(False, "replayed graph outputs differ from the first run", per_tag)

    def drop_graphs(self) -> None:
        """Drop the graphs and their outputs, so nothing holds the graph pool."""
        self.graphs.clear()
        self.torch.cuda.synchronize()

    def close(self) -> None:
        """Drop the graphs and tensors (their memory returns to the pools)."""
        self.graphs.clear()
        self.weights.clear()
        self.inputs.clear()
        self.kv = self.workspace = None
        self.torch.cuda.synchronize()
