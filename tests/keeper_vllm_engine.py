"""The vLLM keeper GPU test's engine: ``vllm.LLM`` with ``--load-format torpor-keeper`` and the torpor sleep backend.

Usage: ``python tests/keeper_vllm_engine.py first|again``. ``first`` generates, updates the final norm's weight
in place (as a trainer's push would: the checkpoint no longer holds the served weights), generates again, sleeps
at level 1, prints one result line and waits to be killed. ``again`` (the restart) loads, generates and prints its
tokens. Each result carries the checksums of every parameter and buffer on the device
(:func:`torpor.bench.vllm_engine.model_checksums`: what decides, as vLLM's greedy tokens of a random-weight model
are not bit-reproducible from one generation to the next; docs/vllm.md, "Exactness"). A result line is :data:`MARK`
and then JSON (vLLM logs to stdout too). The environment (set by the test) names the model, the keeper's socket and
the engine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import vllm_gpu_support as support

from torpor.bench.vllm_engine import model_checksums

MARK = "keeper-test-result: "


def _negate_final_norm(worker: Any) -> str:
    import torch

    params = dict(worker.model_runner.model.named_parameters())
    name = next(n for n in params if n.endswith("norm.weight") and ".layers." not in n)
    with torch.no_grad():
        params[name].neg_()
    torch.cuda.synchronize()
    return name


def main() -> None:
    from vllm import LLM, SamplingParams

    model = Path(os.environ[support.ENV_MODEL])
    llm = LLM(**support.llm_kwargs(model, load_format="torpor-keeper"))
    sampling = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(support.PROMPTS, sampling, use_tqdm=False)]

    def checksums() -> dict[str, str]:
        sums: dict[str, str] = llm.collective_rpc(model_checksums)[0]
        return sums

    generate()  # the first generation after a cold compile may differ (docs/vllm.md, "Exactness")
    if sys.argv[1] == "first":
        checkpoint, loaded = generate(), checksums()
        llm.collective_rpc(_negate_final_norm)
        generate()
        updated = generate()
        result = {"checkpoint": checkpoint, "updated": updated, "loaded_sums": loaded, "updated_sums": checksums()}
        llm.sleep(level=1)
        print(MARK + json.dumps({"pid": os.getpid(), **result}), flush=True)
        time.sleep(600)
    else:
        sums = checksums()
        print(MARK + json.dumps({"pid": os.getpid(), "tokens": generate(), "sums": sums}), flush=True)


if __name__ == "__main__":
    main()
