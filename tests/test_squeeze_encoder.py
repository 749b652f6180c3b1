"""Tests for torpor.allocator.squeeze.encoder: lossless for any bytes, any dtype, any length and chunk size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.allocator.squeeze.decoder import decode, verify
from torpor.allocator.squeeze.encoder import encode
from torpor.allocator.squeeze.layout import CHUNK_HEADER, STREAM_HEADER, read_index

CHUNKS = st.sampled_from([512, 1024, 1536, 4096])
DTYPES = st.sampled_from(["raw", "bfloat16", "float16"])
#: Bit patterns a 16-bit float backup must keep: NaNs with payloads, infinities, subnormals, -0, extremes.
SPECIAL16 = [0x7FC0, 0x7FC1, 0xFFFF, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x8000, 0x0000, 0x7C00, 0xFC00, 0x7E01]


def _weights(n: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.empty(n, dtype=dtype).normal_(0, 0.02, generator=g).view(torch.uint8).numpy().tobytes()


@settings(max_examples=200)
@given(st.binary(max_size=6000), DTYPES, CHUNKS)
def test_any_bytes_round_trip(data: bytes, dtype: str, chunk: int) -> None:
    """Arbitrary bytes of any length come back exactly, under every dtype and chunk size."""
    assert decode(encode(data, dtype, chunk)) == data


@st.composite
def float_words(draw: st.DrawFn) -> bytes:
    """16-bit words mostly like weights, with special patterns and random words mixed in, odd byte tails too."""
    n = draw(st.integers(0, 3000))
    base = np.frombuffer(_weights(n, draw(st.integers(0, 2**31))), dtype=np.uint16).copy()
    for _ in range(draw(st.integers(0, 40))):
        if n:
            at = draw(st.integers(0, n - 1))
            base[at] = draw(st.sampled_from(SPECIAL16) | st.integers(0, 0xFFFF))
    return base.tobytes() + draw(st.binary(max_size=3))


@settings(max_examples=200)
@given(float_words(), st.sampled_from(["bfloat16", "float16"]), CHUNKS)
def test_float_bit_patterns_round_trip(data: bytes, dtype: str, chunk: int) -> None:
    """Weight-like words with NaN payloads, infinities, subnormals, -0 and an odd tail come back bit for bit."""
    assert decode(encode(data, dtype, chunk)) == data


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_every_floating_dtype_round_trips(dtype: torch.dtype) -> None:
    """A tensor of each torch floating dtype (values, inf, nan, -0, subnormal) comes back exactly; 16-bit ones shrink."""
    g = torch.Generator().manual_seed(3)
    t = torch.empty(5000, dtype=torch.float32).normal_(0, 0.02, generator=g)
    t[:4] = torch.tensor([float("inf"), float("nan"), -0.0, 1e-40])
    data = t.to(dtype).view(torch.uint8).numpy().tobytes()
    stream = encode(data, dtype, 2048)
    assert decode(stream) == data
    if dtype in (torch.bfloat16, torch.float16):
        assert verify(stream).coded > 0 and len(stream) < len(data)
    else:
        assert verify(stream).coded == 0


def test_chunk_boundaries_and_the_short_last_chunk() -> None:
    """Lengths at, one under and one over a chunk multiple keep every byte; each chunk covers its own range."""
    whole = _weights(4 * 256 * 3, 1)
    for n in (0, 1, 511, 512, 513, 1023, 1024, 1025, 1536 * 2 - 1, len(whole)):
        data = whole[:n]
        stream = encode(data, "bfloat16", 1536)
        head, records = read_index(stream)
        assert decode(stream) == data
        assert [r.start for r in records] == list(range(0, n, 1536))
        assert sum(r.header.original for r in records) == n == head.length


def test_an_incompressible_chunk_costs_only_its_header() -> None:
    """Random bytes are stored raw: each chunk costs its 24-byte header and no more (chunk sizes are 8-aligned)."""
    data = np.random.default_rng(7).integers(0, 256, 64 * 1024, dtype=np.uint8).tobytes()
    stream = encode(data, "bfloat16", 4096)
    assert verify(stream).coded == 0
    assert len(stream) == len(data) + STREAM_HEADER.size + 16 * CHUNK_HEADER.size


def test_a_chunk_that_shrinks_is_coded_and_one_that_does_not_is_raw() -> None:
    """In one stream, weight-like chunks are coded and a random chunk beside them raw, all restored."""
    noise = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    data = _weights(2048, 2) + noise + _weights(2048, 3)
    stream = encode(data, "bfloat16", 4096)
    _, records = read_index(stream)
    assert [r.header.mode for r in records] == [1, 0, 1]
    assert decode(stream) == data


def test_a_bad_chunk_size_is_refused() -> None:
    """A chunk size that is not a whole number of 512-byte groups is refused, with the rule said."""
    with pytest.raises(ValueError, match="multiple of 512"):
        encode(b"abc", "bfloat16", 1000)
