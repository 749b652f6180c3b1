"""Tests for torpor.allocator.squeeze.gpucodec: the Triton kernels write and read the numpy reference's bytes, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from torpor.allocator.squeeze.decoder import decode
from torpor.allocator.squeeze.encoder import encode
from torpor.allocator.squeeze.faults import ChecksumMismatch, CorruptChunk
from torpor.allocator.squeeze.layout import read_index
from torpor.allocator.squeeze.sum64 import sum64

torch = pytest.importorskip("torch", reason="needs torch (the cuda extra) and a CUDA GPU")

ROOT = Path(__file__).resolve().parent.parent
SPECIAL = [0x7FC0, 0x7FC1, 0xFFFF, 0x7F80, 0xFF80, 0x0001, 0x8000, 0x0000, 0x7C00, 0xFC00, 0x7E01]


def cases(device: str) -> list[tuple[str, torch.Tensor, int]]:
    """(dtype, bytes, chunk size) cases: weights with special patterns, odd tails, chunk boundaries, random bytes."""
    g = torch.Generator().manual_seed(11)
    out = []
    for dtype in (torch.bfloat16, torch.float16):
        for n, chunk in ((40_000, 4096), (4096 * 3, 4096), (4096 * 3 + 1, 4096), (513, 1024), (511, 512), (0, 512)):
            t = torch.empty(n // 2 + 1, dtype=dtype).normal_(0, 0.02, generator=g)
            words = t.view(torch.int16)
            picks = torch.randint(0, words.numel(), (min(30, words.numel()),), generator=g)
            words[picks] = torch.tensor(SPECIAL * 3, dtype=torch.int32)[: picks.numel()].to(torch.int16)
            out.append((str(dtype).removeprefix("torch."), t.view(torch.uint8)[:n].clone().to(device), chunk))
    noise = torch.randint(0, 256, (20_001,), generator=g, dtype=torch.uint8)
    out += [("bfloat16", noise.to(device), 4096), ("raw", noise.to(device), 1024)]
    return out


def check_both_directions(device: str) -> int:
    """Encode on the device equals the reference stream; the reference stream decodes on the device to the bytes."""
    from torpor.allocator.squeeze.gpucodec import decode_gpu, encode_gpu, sum64_gpu

    for dtype, data, chunk in cases(device):
        host = data.cpu().numpy()
        reference = encode(host, dtype, chunk)
        stream = encode_gpu(data, dtype, chunk)
        assert bytes(stream.cpu().numpy()) == reference, (dtype, data.numel(), chunk)
        head, records = read_index(reference)
        restored = decode_gpu(torch.frombuffer(bytearray(reference), dtype=torch.uint8).to(device), head, records)
        assert torch.equal(restored.cpu(), data.cpu()), (dtype, data.numel(), chunk)
        sums = sum64_gpu(data, chunk).cpu().numpy().view(np.uint64).tolist()
        assert sums == [sum64(host[i : i + chunk], i) for i in range(0, host.size, chunk)]
    return len(cases("cpu"))


def check_damage_is_named(device: str) -> None:
    """A flipped stored byte is a ChecksumMismatch on the device, a bad section size a CorruptChunk, as on the host."""
    from torpor.allocator.squeeze.gpucodec import decode_gpu

    dtype, data, chunk = cases("cpu")[0]
    reference = bytearray(encode(data.numpy(), dtype, chunk))
    head, records = read_index(bytes(reference))
    coded = records[2]
    low = coded.payload_at + coded.header.payload - 500
    reference[low] ^= 0x10
    stream = torch.frombuffer(bytearray(reference), dtype=torch.uint8).to(device)
    with pytest.raises(ChecksumMismatch) as caught:
        decode_gpu(stream, head, records)
    assert (caught.value.chunk, caught.value.start) == (2, 2 * chunk)
    with pytest.raises(ChecksumMismatch):
        decode(bytes(reference))
    reference[low] ^= 0x10
    reference[coded.payload_at + chunk // 512 + 1] = 9  # a width over bf16's 8 exponent bits
    with pytest.raises(CorruptChunk, match="width is 9"):
        decode_gpu(torch.frombuffer(bytearray(reference), dtype=torch.uint8).to(device), head, records)


@pytest.mark.gpu
def test_gpu_kernels_match_the_reference_in_both_directions() -> None:
    """On CUDA: encode_gpu writes the reference's bytes, decode_gpu restores the reference's stream, sum64 agrees."""
    check_both_directions("cuda")


@pytest.mark.gpu
def test_gpu_decode_names_damage() -> None:
    """On CUDA: a flipped byte is a ChecksumMismatch naming its chunk; an impossible width a CorruptChunk."""
    check_damage_is_named("cuda")


def test_the_kernels_match_the_reference_in_tritons_interpreter() -> None:
    """Without a GPU: the same kernels under TRITON_INTERPRET=1 (on CPU tensors) agree with the reference both ways."""
    pytest.importorskip("triton")
    code = (
        "import tests.test_squeeze_gpucodec as t; n = t.check_both_directions('cpu'); "
        "t.check_damage_is_named('cpu'); print('cases', n)"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    assert done.returncode == 0 and "cases 14" in done.stdout, done.stdout + done.stderr


#: Each kernel's argument types for an ahead-of-time compile (pointers by element type, scalars, constexprs).
SIGNATURES = {
    "sum64_partial": ({"src": "*u8", "length": "i64", "chunk_size": "i32", "partial": "*i64", "blocks": "i32"}, {"WORDS": 1024}),
    "sum64_finish": ({"partial": "*i64", "blocks": "i32", "length": "i64", "chunk_size": "i32", "out": "*i64"}, {"BLOCKS": 64}),
    "plan": ({"src": "*i16", "groups": "i32", "bases": "*u8", "widths": "*u8", "escapes": "*u8"}, {"E": 8, "M": 7, "GPB": 4}),
    "pack": (
        {"src": "*i16", "bases": "*u8", "widths": "*u8", "group_words": "*i64", "group_escapes": "*i64", "info": "*i64",
         "out8": "*u8", "out32": "*i32", "gpc": "i32"},
        {"E": 5, "M": 10, "H": 3},
    ),
    "unpack": (
        {"stream8": "*u8", "stream32": "*i32", "group_words": "*i64", "group_escapes": "*i64", "info": "*i64",
         "out": "*i16", "gpc": "i32"},
        {"E": 5, "M": 10, "H": 3},
    ),
    "copy_segments": ({"src": "*u8", "dst": "*u8", "segments": "*i64"}, {"BLOCK": 4096}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_each_kernel_compiles_for_hopper_without_a_gpu(name: str) -> None:
    """Each kernel compiles ahead of time for sm_90 to a cubin: what the interpreter does not check (globals, types)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from torpor.allocator.squeeze import kernels

    args, constants = SIGNATURES[name]
    source = ASTSource(getattr(kernels, name), {**args, **dict.fromkeys(constants, "constexpr")}, constexprs=constants)
    assert "cubin" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm
