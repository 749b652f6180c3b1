"""The allocator facade vLLM gets, on a real GPU without vLLM: the calls vLLM makes, then sleep and wake, bit-exact.

vLLM 0.33 cannot run on the GPU machine here (torch 2.11 there, vLLM pins
2.14.0), so this drives the facade exactly as vLLM's worker and capture
routing do (``use_memory_pool(tag=...)``, ``get_current_usage()``,
``cudagraph_pool()`` around ``torch.cuda.graph(g, pool)``, then the backend's
controller calls) on CUDA memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def test_facade_drives_cuda_memory_like_vllm(tmp_path: Path) -> None:
    """Weights, KV cache and a graph with a write-once pool constant: L1 RL wake and L2 + reload replay bit-exact."""
    from torpor.allocator import TaggedAllocator
    from torpor.hooks.vllm.facade import TorporMemAllocator
    from torpor.statemachine import read_events

    allocator = TorporMemAllocator(TaggedAllocator(), log_dir=tmp_path, engine="vllm", rank=0, fsync=False)
    assert allocator.get_current_usage() == 0  # vLLM's worker asserts this before loading weights
    torch.manual_seed(0)
    with allocator.use_memory_pool(tag="weights"):
        weights = torch.randn(4096, 4096, device="cuda")  # 64 MiB
    with allocator.use_memory_pool(tag="kv_cache"):
        kv = torch.ones(4096, 2048, device="cuda")  # 32 MiB
    reference_weights = weights.cpu()
    x = torch.randn(64, 4096, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _ = x @ weights  # warm up cuBLAS outside the capture, as vLLM does
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with allocator.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool):
        constant = torch.empty(64, 4096, device="cuda")  # in the graph pool, written once after capture
        out = x @ weights + constant
    constant.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    expected = out.clone()
    tagged = allocator.get_current_usage()
    assert tagged >= 96 << 20

    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    usage_awake = dict(allocator.memory.usage())
    allocator.controller.sleep(1)
    torch.cuda.synchronize()
    free_asleep = torch.cuda.mem_get_info()[0]
    freed = free_asleep - free_awake
    assert freed >= 0.999 * tagged, f"freed {freed} of {tagged} tagged bytes; awake usage {usage_awake}"
    allocator.wake_up(["weights"])  # the RL order: weights first (graphs and runtime come back too)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    allocator.wake_up(["kv_cache"])
    assert allocator.controller.state.value == "awake"
    kv.fill_(1.0)

    allocator.controller.sleep(2)  # weights discarded, graph pool still backed up
    allocator.wake_up(None)
    weights.copy_(reference_weights.cuda())  # level 2: the engine reloads its weights
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)

    del graph, out, constant
    allocator.release_pools()
    kinds = [e.kind.value for e in read_events(tmp_path / "vllm.rank0.jsonl")]
    assert kinds.count("sleep_completed") == 2
    assert "graph_captured" in kinds
    assert kinds[-1] == "closed"
