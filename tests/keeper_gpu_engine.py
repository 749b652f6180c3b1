"""The GPU keeper test's two processes: a transformers engine that sleeps at level 1 with a keeper, and its adopter.

Usage: ``python tests/keeper_gpu_engine.py engine SOCKET ENGINE`` (prints its greedy tokens once asleep, then waits
to be killed) or ``python tests/keeper_gpu_engine.py adopt SOCKET ENGINE LOG`` (builds the same model with other
values after prefetching the backup, adopts it, prints its tokens, the adoption and the tokens it had before adopting).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from torpor import SleepController
from torpor.allocator import TaggedAllocator
from torpor.bench import realmodel as rm
from torpor.keeper import adopt, attach, prefetch, track_model, wait_released
from torpor.testing import FakeMemory

SOURCE = "Qwen3-1.7B-shape, 4 layers (tests/keeper_gpu_engine.py)"


def _config() -> Any:
    return rm.config("dense", num_hidden_layers=4)


def _generate(model: Any, cfg: Any) -> list[int]:
    ids = rm.prompt(cfg, n=16)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0].tolist()]


def engine(sock: str, name: str) -> None:
    cfg = _config()
    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    backing = attach(alloc, ctl, keeper=sock, engine=name)
    with alloc.use_memory_pool("weights"):
        model = rm.build(cfg, seed=0)
    track_model(backing, model, SOURCE)
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.full((256 << 20,), 7, dtype=torch.uint8, device="cuda")
    tokens = _generate(model, cfg)
    torch.cuda.synchronize()
    ctl.sleep(1)
    status = backing.status()
    print(json.dumps({"pid": os.getpid(), "tokens": tokens, "kv": kv.numel(), **status}), flush=True)
    time.sleep(600)


def adopter(sock: str, name: str, log: str) -> None:
    pinned = prefetch(keeper=sock, engine=name, device=torch.cuda.current_device())  # as an engine starts
    cfg = _config()
    model = rm.build(cfg, seed=99)  # a fresh process, other values: adoption must bring the engine's
    before = _generate(model, cfg)
    ctl = SleepController(FakeMemory({"weights": 1}), log=log)
    t0 = time.perf_counter()
    adopted = adopt(model, source=SOURCE, keeper=sock, engine=name, controller=ctl)
    seconds = time.perf_counter() - t0
    ctl.close()
    tokens = _generate(model, cfg)
    released = wait_released(60)
    result = {"tokens": tokens, "before": before, "adopted": str(adopted), "seconds": seconds}
    print(json.dumps({**result, "prefetched": pinned is not None, "released": released}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        engine(sys.argv[2], sys.argv[3])
    else:
        adopter(sys.argv[2], sys.argv[3], sys.argv[4])
