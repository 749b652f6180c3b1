"""Tests for torpor.allocator.squeeze.decoder: damage is a named error with its chunk and range, never wrong bytes."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.allocator.squeeze.decoder import decode, verify
from torpor.allocator.squeeze.encoder import encode
from torpor.allocator.squeeze.faults import ChecksumMismatch, CorruptChunk, SqueezeError
from torpor.allocator.squeeze.layout import CHUNK_HEADER, read_index


def _weights(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.empty(n, dtype=torch.bfloat16).normal_(0, 0.02, generator=g).view(torch.uint8).numpy().tobytes()


DATA = _weights(3 * 1024 + 100, 5) + np.random.default_rng(2).integers(0, 256, 2048, dtype=np.uint8).tobytes()
STREAM = encode(DATA, "bfloat16", 2048)


def _flip(stream: bytes, at: int, mask: int = 0x01) -> bytes:
    changed = bytearray(stream)
    changed[at] ^= mask
    return bytes(changed)


@settings(max_examples=300)
@given(st.integers(0, len(STREAM) - 1), st.integers(1, 255))
def test_a_changed_byte_anywhere_is_refused_or_harmless(at: int, mask: int) -> None:
    """Any byte of the stream changed: decode raises a SqueezeError or returns exactly the original bytes."""
    with contextlib.suppress(SqueezeError):
        assert decode(_flip(STREAM, at, mask)) == DATA


def test_a_flipped_byte_in_a_raw_chunk_is_a_checksum_mismatch_naming_the_chunk() -> None:
    """A bit flipped in a raw chunk's payload raises ChecksumMismatch with its index and original byte range."""
    _, records = read_index(STREAM)
    raw = next(r for r in records if r.header.mode == 0)
    with pytest.raises(ChecksumMismatch) as caught:
        decode(_flip(STREAM, raw.payload_at + 100))
    assert (caught.value.chunk, caught.value.start, caught.value.end) == (raw.chunk, raw.start, raw.start + 2048)
    assert f"chunk {raw.chunk} (original bytes {raw.start}..{raw.start + 2048})" in str(caught.value)


def test_a_flipped_mantissa_byte_in_a_coded_chunk_is_a_checksum_mismatch() -> None:
    """A bit flipped in a coded chunk's stored mantissas decodes to other bytes, and the checksum names the chunk."""
    _, records = read_index(STREAM)
    coded = records[1]
    assert coded.header.mode == 1
    low = coded.payload_at + coded.header.payload - 10 - 3 * 100  # inside rest-low, before escapes and tail
    with pytest.raises(ChecksumMismatch) as caught:
        decode(_flip(STREAM, low))
    assert caught.value.chunk == 1 and caught.value.expected == coded.header.checksum


def test_a_changed_recorded_checksum_is_a_mismatch() -> None:
    """A chunk header's recorded sum64 changed: the restored bytes no longer match it."""
    _, records = read_index(STREAM)
    at = records[0].payload_at - 1  # the checksum's top byte
    with pytest.raises(ChecksumMismatch, match="chunk 0"):
        verify(_flip(STREAM, at))


def test_a_coded_chunk_whose_escape_counts_disagree_is_corrupt() -> None:
    """A group's escape count raised: the chunk is refused as corrupt, with its index, range and stream offset."""
    _, records = read_index(STREAM)
    coded = records[0]
    groups = 2048 // 2 // 256
    with pytest.raises(CorruptChunk) as caught:
        decode(_flip(STREAM, coded.payload_at + 2 * groups, 0x80))
    assert (caught.value.chunk, caught.value.at) == (0, coded.payload_at)


def test_a_code_width_over_the_exponent_bits_is_corrupt() -> None:
    """A group width of 200 is refused before any plane is read."""
    _, records = read_index(STREAM)
    changed = bytearray(STREAM)
    changed[records[0].payload_at + 4] = 200
    with pytest.raises(CorruptChunk, match="width is 200"):
        decode(bytes(changed))


def test_verify_says_what_the_stream_holds() -> None:
    """verify() returns the dtype, length, chunk counts and the stream's size over the original's."""
    found = verify(STREAM)
    assert (found.dtype, found.length, found.chunks, found.coded) == ("bfloat16", len(DATA), 5, 3)
    assert found.ratio == len(STREAM) / len(DATA) and found.stream_bytes == len(STREAM)
    assert CHUNK_HEADER.size == 24
