"""vllm.LLM with sleep_mode_backend="torpor" on a GPU: level 1, the RL order, level 2, graphs offloaded, outputs exact.

One engine start (torch.compile + FULL_AND_PIECEWISE CUDA graphs, graphs in
torpor's pool) serves every check, because each start costs about a minute.
The model is the kit's tiny random-weight Qwen3 (``TORPOR_VLLM_MODEL``, built
offline by scripts/gpu-vllm). After every wake the greedy tokens of four
prompts must equal the first run's, vLLM's ``is_sleeping`` must agree with the
rank's event log and with ``torpor status``, and the device memory freed must
cover what torpor's log says it released.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vllm_gpu_support as support

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]  # an engine start with torch.compile takes a minute or more

ENGINE = "llm-gpu-test"


def test_llm_sleep_wake_rl_order_and_level2_with_graph_offload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """L1 x3, RL order with an in-place weight update, L2 + reload: outputs exact, is_sleeping = log = torpor status."""
    model = support.require_vllm_gpu()
    from vllm import LLM, SamplingParams

    from torpor.bench.vllm_engine import model_checksums
    from torpor.readmodel.ranklogs import fleet
    from torpor.statemachine import read_events
    from torpor.statemachine.core.events import EventKind

    log_dir = tmp_path / "logs"
    monkeypatch.setenv("TORPOR_LOG_DIR", str(log_dir))
    monkeypatch.setenv("TORPOR_ENGINE", ENGINE)
    monkeypatch.setenv("VLLM_PLUGINS", "torpor")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the weight update is a function sent to the worker

    def negate_final_norm(worker: Any) -> str:
        """Run in the worker (collective_rpc): negate the final RMSNorm weight in place, inside the captured graphs."""
        import torch

        params = dict(worker.model_runner.model.named_parameters())
        name = next(n for n in params if n.endswith("norm.weight") and ".layers." not in n)
        with torch.no_grad():
            params[name].neg_()
        torch.cuda.synchronize()
        return name

    llm = LLM(**support.llm_kwargs(model))
    core = llm.llm_engine.engine_core
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # random weights may pick EOS early

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(support.PROMPTS, sampling, use_tqdm=False)]

    def rank0() -> dict[str, Any]:
        return fleet(log_dir, engine=ENGINE).engine(ENGINE).rank(0).to_dict()

    def agree(expected_rank_state: str, expected_engine_state: str) -> None:
        view = support.torpor_status(log_dir, ENGINE)
        rank = rank0()
        sleeping = core.is_sleeping()
        assert rank["state"] == expected_rank_state, rank
        assert view["state"] == expected_engine_state, view
        assert view["ranks"][0]["state"] == rank["state"]
        assert sleeping == (expected_rank_state != "awake"), f"vLLM is_sleeping={sleeping}, torpor {rank['state']}"

    import torch  # after the engine is up: a CUDA context here must not precede its start

    # the baseline is a generation after a warm-up one: vLLM's first generation after a cold compile can
    # differ from later ones with every tensor unchanged (seen at 8B on the H200: docs/vllm.md, "Exactness")
    generate()
    baseline = generate()
    assert all(len(t) == 24 for t in baseline)
    checksums = llm.collective_rpc("compute_weight_checksums")
    every_tensor = llm.collective_rpc(model_checksums)[0]  # every parameter and buffer: what decides exactness
    agree("awake", "awake")
    first = rank0()["residency"]
    for tag in ("weights", "kv_cache"):
        assert first.get(tag, {}).get("resident", 0) > 0, f"no {tag} bytes in torpor's pools: {first}"
    graph_bytes = 0

    # level 1, three times: weights and graphs to the host, KV cache discarded, all back at the same addresses
    for cycle in range(3):
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        llm.sleep(level=1)
        freed = torch.cuda.mem_get_info()[0] - free_awake
        agree("asleep_l1", "asleep")
        asleep = rank0()["residency"]
        assert all(u["resident"] == 0 for u in asleep.values()), asleep
        # the host holds the live bytes (torch's blocks in use), at most what was mapped
        assert 0 < asleep["weights"]["host"] <= first["weights"]["resident"], (first, asleep)
        assert asleep["kv_cache"]["discarded"] > 0, (first, asleep)
        assert asleep["cudagraph"]["host"] > 0, f"the graph pool was not offloaded: {asleep}"
        assert graph_bytes in (0, asleep["cudagraph"]["host"]), "the graph pool grew between sleeps"
        graph_bytes = asleep["cudagraph"]["host"]
        released = sum(u["host"] + u["discarded"] for u in asleep.values())
        assert freed >= 0.98 * released, f"cycle {cycle}: the GPU got {freed} bytes back; torpor released {released}"
        assert llm.wake_up() is True
        agree("awake", "awake")
        after = llm.collective_rpc(model_checksums)[0]
        changed = sorted(n for n in every_tensor if after.get(n) != every_tensor[n])
        assert not changed, (
            f"level-1 cycle {cycle} changed {len(changed)} of {len(every_tensor)} tensors: {changed[:5]}"
        )
        assert generate() == baseline, f"outputs changed after level-1 cycle {cycle}"

    # the RL order: weights back, updated in place, then the KV cache; graphs replay on the new weights
    for update in ("negate", "negate back"):
        llm.sleep(level=1)
        agree("asleep_l1", "asleep")
        assert llm.wake_up(tags=["weights"]) is False  # vLLM: not fully awake yet
        agree("partially_awake", "partially_awake")
        partial = rank0()["residency"]
        assert partial["weights"]["resident"] > 0, partial
        assert partial["kv_cache"]["resident"] == 0
        names = llm.collective_rpc(negate_final_norm)
        assert llm.wake_up(tags=["kv_cache"]) is True
        agree("awake", "awake")
        out = generate()
        if update == "negate":
            assert out != baseline, f"negating {names} changed no output: the graphs did not read the new weights"
            assert llm.collective_rpc("compute_weight_checksums") != checksums
        else:
            assert out == baseline, "negating twice did not give the first outputs back"
            assert llm.collective_rpc("compute_weight_checksums") == checksums

    # level 2: weights discarded (graphs still backed up), reloaded from disk after the weights' wake
    llm.sleep(level=2)
    agree("asleep_l2", "asleep")
    deep = rank0()["residency"]
    assert deep["weights"]["host"] == 0 and deep["weights"]["resident"] == 0, deep
    assert deep["cudagraph"]["host"] == graph_bytes, deep
    assert llm.wake_up(tags=["weights"]) is False
    llm.collective_rpc("reload_weights")
    assert llm.wake_up(tags=["kv_cache"]) is True
    agree("awake", "awake")
    assert generate() == baseline, "outputs changed after level 2 and reload_weights"
    assert llm.collective_rpc("compute_weight_checksums") == checksums

    events = list(read_events(log_dir / f"{ENGINE}.rank0.jsonl"))
    kinds = [e.kind for e in events]
    assert kinds.count(EventKind.SLEEP_COMPLETED) == 6
    assert kinds.count(EventKind.WAKE_COMPLETED) == 3 + 2 * 2 + 2
    bad = {EventKind.REFUSED, EventKind.SLEEP_ABORTED, EventKind.WAKE_FAILED, EventKind.TAG_ROLLED_BACK}
    assert not [e for e in events if e.kind in bad], [e for e in events if e.kind in bad]
    assert kinds.count(EventKind.GRAPH_CAPTURED) > 0
    backed_up_graphs = [e for e in events if e.kind is EventKind.TAG_BACKED_UP and e.data.get("tag") == "cudagraph"]
    assert len(backed_up_graphs) == 6  # graphs go to the host at both levels
