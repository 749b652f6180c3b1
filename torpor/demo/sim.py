"""The demo's workload on the simulated device: the GPU demo's tags and sizes, scaled down, as real bytes.

The simulated driver (``torpor.allocator.SimDriver``) keeps device memory in
host RAM, so the demo scales every size of the GPU workload down by
:data:`SCALE`. Each allocation holds seeded pseudo-random bytes (SHAKE-128); the check compares
each allocation's SHA-256 with the one taken after setup, so "exact" means
every restored byte is the byte that was there before sleep.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
from torpor.demo.workload import BATCH_SIZES, Check
from torpor.statemachine import Memory, SleepController
from torpor.units import MiB, byte_size

#: The simulated sizes are the GPU demo's divided by this.
SCALE = 64
#: GPU demo sizes per allocation, before scaling (see torpor.demo.gpu).
GPU_LAYOUT: tuple[tuple[str, str, int], ...] = (
    ("weights", "embed", 125 * MiB),
    *(("weights", f"layer{i}", 96 * MiB) for i in range(8)),
    *(("kv_cache", f"kv.layer{i}", 256 * MiB) for i in range(8)),
    ("runtime", "workspace", 64 * MiB),
)
#: Graph pool bytes per captured batch size: one 2 MiB granule each, the least a mapping takes (not scaled).
GRAPH_BYTES = 2 * MiB


@dataclass
class _Alloc:
    tag: str
    name: str
    address: int
    nbytes: int
    seed: int
    digest: bytes = b""


class _SimGraph:
    """Stands for a captured CUDA graph: the pool holds it weakly and names its site."""

    def __init__(self, site: str) -> None:
        self.site = site


class SimWorkload:
    """Weights, kv_cache, runtime and one graph allocation per batch size, on a ``SimDriver``."""

    device = "sim"
    untagged = f"the simulated driver's stand-in for a CUDA context: 512 MiB scaled 1/{SCALE}"

    def __init__(self, scale: int = SCALE, seed: int = 0) -> None:
        self.scale = scale
        self.seed = seed
        total = sum(n for _, _, n in GPU_LAYOUT) // scale + GRAPH_BYTES * len(BATCH_SIZES)
        self.capacity = 2 * total + 64 * MiB
        # what a CUDA context, cuBLAS and NCCL hold on a GPU (about 500 MiB on an H200), scaled like the rest
        self.driver = SimDriver(capacity=self.capacity, overhead=512 * MiB // scale)
        # pinned host memory in small chunks: the simulated host backup is real RAM too
        self.allocator = TaggedAllocator(driver=self.driver, host=HostPolicy(chunk_bytes=8 * MiB))
        self.allocs: list[_Alloc] = []
        self.graphs: list[_SimGraph] = []

    @property
    def memory(self) -> Memory:
        """The tagged allocator on the simulated driver."""
        return self.allocator  # type: ignore[no-any-return]

    def describe(self) -> list[str]:
        """What runs where."""
        gpu_total = sum(n for _, _, n in GPU_LAYOUT)  # the graphs' pool on a GPU is what capture takes: not scaled
        granule = byte_size(self.driver.granularity(0)).replace(".00 ", " ")
        return [
            "device     simulated (torpor.allocator.SimDriver: device memory is real bytes in host RAM)",
            f"workload   the GPU demo's weights, kv_cache and runtime ({byte_size(gpu_total)}) scaled 1/{self.scale}, "
            f"plus one {granule} granule of graph memory per batch size",
            f"           ({byte_size(self.tagged_bytes())} tagged, each allocation rounded up to the granule) "
            "to stay small in RAM; timings are host-memory copies, not a GPU link",
            f"graphs     one per batch size {', '.join(map(str, BATCH_SIZES))} in the cudagraph pool",
            "check      SHA-256 of every allocation after each wake vs the bytes written before the first sleep",
        ]

    def tagged_bytes(self) -> int:
        """The device bytes :meth:`setup` maps: every scaled allocation rounded up to the granule, graphs included."""
        granule = self.driver.granularity(0)
        sizes = [self._size(n) for _, _, n in GPU_LAYOUT] + [GRAPH_BYTES] * len(BATCH_SIZES)
        return sum(-(-n // granule) * granule for n in sizes)

    def _size(self, nbytes: int) -> int:
        return max(nbytes // self.scale, 4096)

    def _content(self, a: _Alloc) -> bytes:
        return hashlib.shake_128(a.seed.to_bytes(8, "little")).digest(a.nbytes)

    def _fill(self, a: _Alloc) -> None:
        self.driver.write(a.address, self._content(a))

    def _digest(self, a: _Alloc) -> bytes:
        return hashlib.sha256(self.driver.read(a.address, a.nbytes)).digest()

    def _kv_seed(self, weights: bytes, index: int) -> int:
        """kv_cache content depends on the weights (a prefill reads them) and the prompt."""
        return int.from_bytes(hashlib.sha256(weights + index.to_bytes(4, "little")).digest()[:8], "little")

    def setup(self, controller: SleepController) -> None:
        """Allocate and fill weights and runtime, prefill kv_cache, capture a graph per batch size."""
        for i, (tag, name, nbytes) in enumerate(GPU_LAYOUT):
            size = self._size(nbytes)
            address = self.allocator.allocate(size, tag)
            self.allocs.append(_Alloc(tag, name, address, size, self.seed * 1000 + i))
        for a in self.allocs:
            if a.tag != "kv_cache":
                self._fill(a)
        self._prefill()
        controller.observe()
        for batch in BATCH_SIZES:
            site = f"decode batch={batch}"
            with controller.capture(site) as handle:
                size = GRAPH_BYTES
                address = self.allocator.allocate(size, "cudagraph")
                graph = _SimGraph(site)
                track = getattr(handle, "track", None)
                if callable(track):
                    track(graph)  # the pool now names this graph as a holder
                self.graphs.append(graph)
            a = _Alloc("cudagraph", site, address, size, self.seed * 1000 + 500 + batch)
            self._fill(a)  # the graph's write-once state, written after capture
            self.allocs.append(a)
        for a in self.allocs:
            a.digest = self._digest(a)
        controller.observe()

    def _prefill(self) -> None:
        weights = b"".join(self._digest(a) for a in self.allocs if a.tag == "weights")
        for i, a in enumerate(x for x in self.allocs if x.tag == "kv_cache"):
            a.seed = self._kv_seed(weights, i)
            self._fill(a)

    def prepare(self, woken: Sequence[str], reload_weights: bool) -> None:
        """Reload weights from their 'checkpoint' (level 2), then prefill kv_cache if it woke."""
        if reload_weights and "weights" in woken:
            for a in self.allocs:
                if a.tag == "weights":
                    self._fill(a)
        if "kv_cache" in woken:
            self._prefill()

    def check(self, tags: Sequence[str], refilled: Sequence[str], reloaded: Sequence[str]) -> Check:
        """Compare every allocation of ``tags`` with its digest from setup."""
        per_tag: dict[str, str] = {}
        count = 0
        for a in self.allocs:
            if a.tag not in tags:
                continue
            count += 1
            same = self._digest(a) == a.digest
            label = "reloaded" if a.tag in reloaded else "refilled" if a.tag in refilled else "exact"
            if not same:
                per_tag[a.tag] = "DIFFERS"
            else:
                per_tag.setdefault(a.tag, label)
        exact = all(v != "DIFFERS" for v in per_tag.values())
        return Check(exact, f"{count} allocations byte-for-byte equal" if exact else "bytes differ", per_tag)

    def drop_graphs(self) -> None:
        """Forget the graphs (their pool memory goes with the pool's release)."""
        self.graphs.clear()
        self.allocs = [a for a in self.allocs if a.tag != "cudagraph"]

    def close(self) -> None:
        """Free every allocation still held."""
        for a in self.allocs:
            self.allocator.free(a.address)
        self.allocs.clear()
