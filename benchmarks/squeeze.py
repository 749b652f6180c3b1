"""The squeezed-backup format's ratios (numpy, CPU) and its GPU kernels' throughput (Triton, CUDA).

Run ``python benchmarks/squeeze.py`` for the ratios: compressed bytes (the whole stream, headers
included) over original bytes, encoded by the numpy reference and decoded back (checked equal) for

* ``qwen3-linear``: a bf16 weight of a Qwen3-8B MLP linear (4096 x 12288) initialised as
  transformers initialises one (``normal_(0, initializer_range=0.02)`` in the weight's dtype);
* ``vllm-dummy``: the same shape filled as vLLM's dummy load format fills a bf16 weight
  (``initialize_single_dummy_weight``: ``uniform_(-1e-3, 1e-3)``, seed 1234);
* ``random-bytes``: 64 MiB of uniformly random bytes, encoded as bf16;

and the same two weights in fp16. ``--gpu`` adds the GPU figures on a 1 GiB bf16 tensor
(transformers' init): encode, decode (sum64 check included) and sum64 alone, median of
``--rounds``, GB/s of original bytes (1e9). One JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torpor.allocator.squeeze import decode, encode, read_index

SHAPE = (4096, 12288)


def weights(kind: str, dtype: torch.dtype, shape: tuple[int, ...] = SHAPE, device: str = "cpu") -> torch.Tensor:
    """A weight as transformers (``qwen3-linear``) or vLLM's dummy loader (``vllm-dummy``) fills it, fixed seed."""
    t = torch.empty(shape, dtype=dtype, device=device)
    g = torch.Generator(device=device)
    if kind == "qwen3-linear":
        g.manual_seed(0)
        return t.normal_(0.0, 0.02, generator=g)
    g.manual_seed(1234)
    return t.uniform_(-1e-3, 1e-3, generator=g)


def ratio(name: str, data: np.ndarray, dtype: str) -> dict[str, Any]:
    """Encode and decode ``data`` with the numpy reference: the ratio, the seconds, the check."""
    t0 = time.perf_counter()
    stream = encode(data, dtype)
    t1 = time.perf_counter()
    same = decode(stream) == data.tobytes()
    t2 = time.perf_counter()
    _, records = read_index(stream)
    coded = sum(1 for r in records if r.header.mode)
    return {
        "figure": "ratio", "case": name, "dtype": dtype, "bytes": int(data.nbytes), "stream_bytes": len(stream),
        "ratio": round(len(stream) / data.nbytes, 4), "chunks": len(records), "coded_chunks": coded,
        "lossless": same, "numpy_encode_s": round(t1 - t0, 2), "numpy_decode_s": round(t2 - t1, 2),
    }  # fmt: skip


def timed(fn: Callable[[], Any], rounds: int) -> tuple[float, Any]:
    """The median seconds of ``fn`` over ``rounds`` (after one warm-up), CUDA synchronized, and its last result."""
    result = fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def gpu(rounds: int) -> list[dict[str, Any]]:
    """Encode, decode and sum64 throughput of 1 GiB of bf16 weights on the current CUDA device."""
    from torpor.allocator.squeeze.gpucodec import decode_gpu, encode_gpu, sum64_gpu

    out = []
    for kind in ("qwen3-linear", "vllm-dummy"):
        data = weights(kind, torch.bfloat16, (1 << 29,), "cuda")
        n = data.numel() * 2
        enc_s, stream = timed(lambda d=data: encode_gpu(d), rounds)  # type: ignore[misc]
        head, records = read_index(stream.cpu().numpy())
        dec_s, restored = timed(lambda s=stream, h=head, r=records: decode_gpu(s, h, r), rounds)  # type: ignore[misc]
        sum_s, _ = timed(lambda d=data: sum64_gpu(d), rounds)  # type: ignore[misc]
        out.append({
            "figure": "gpu", "case": kind, "device": torch.cuda.get_device_name(), "bytes": n,
            "ratio": round(stream.numel() / n, 4), "lossless": bool(torch.equal(restored.view(torch.bfloat16), data)),
            "encode_s": round(enc_s, 5), "decode_s": round(dec_s, 5), "sum64_s": round(sum_s, 5),
            "encode_gbps": round(n / enc_s / 1e9, 1), "decode_gbps": round(n / dec_s / 1e9, 1),
            "sum64_gbps": round(n / sum_s / 1e9, 1), "rounds": rounds,
        })  # fmt: skip
        del data, stream, restored
        torch.cuda.empty_cache()
    return out


def main() -> None:
    """Print the ratio figures (and with --gpu the GPU figures) as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="add the GPU throughput on a 1 GiB bf16 tensor")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-ratios", action="store_true", help="skip the CPU ratios")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.node(), "cpu": platform.processor(), "torch": torch.__version__}))
    if not args.no_ratios:
        for kind in ("qwen3-linear", "vllm-dummy"):
            for dtype in (torch.bfloat16, torch.float16):
                data = weights(kind, dtype).view(torch.int16).numpy()
                print(json.dumps(ratio(kind, data, str(dtype).removeprefix("torch."))), flush=True)
        noise = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
        print(json.dumps(ratio("random-bytes", noise, "bfloat16")), flush=True)
    if args.gpu:
        for line in gpu(args.rounds):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
