"""Tests for torpor.allocator.squeeze.layout: headers read back, and every malformed header refused by name."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torpor.allocator.squeeze.encoder import encode
from torpor.allocator.squeeze.faults import BadHeader, SqueezeError
from torpor.allocator.squeeze.layout import (
    BF16,
    FP16,
    RAW,
    STREAM_HEADER,
    ChunkHeader,
    StreamHeader,
    read_index,
    read_stream_header,
    sections,
    spec_of,
)

STREAM = encode(bytes(range(256)) * 20, "float16", 1024)


def _patch(stream: bytes, fmt: str, at: int, value: int | bytes) -> bytes:
    changed = bytearray(stream)
    struct.pack_into(fmt, changed, at, value)
    return bytes(changed)


def test_headers_pack_and_read_back() -> None:
    """A stream header and its chunk headers read back as they were packed."""
    head, records = read_index(STREAM)
    assert head == StreamHeader(FP16, 1024, 5120, 5)
    assert [r.start for r in records] == [0, 1024, 2048, 3072, 4096]
    assert ChunkHeader(*records[0].header).pack() == STREAM[32:56]


@pytest.mark.parametrize(
    ("fmt", "at", "value", "field"),
    [
        ("<4s", 0, b"NOPE", "magic"),
        ("<H", 4, 9, "version"),
        ("<B", 6, 77, "dtype"),
        ("<B", 7, 1, "reserved"),
        ("<I", 8, 1000, "chunk_size"),
        ("<I", 8, 0, "chunk_size"),
        ("<Q", 16, 5121, "chunks"),
        ("<Q", 24, 4, "chunks"),
        ("<B", 32, 9, "mode"),
        ("<I", 36, 1023, "original bytes"),
        ("<I", 40, 0xFFFFFFFF, "payload bytes"),
        ("<I", 44, 3, "payload bytes"),
    ],
)
def test_a_malformed_header_is_refused_by_field(fmt: str, at: int, value: int | bytes, field: str) -> None:
    """Each field out of range is refused as BadHeader naming the field and where, before any payload is read."""
    with pytest.raises(BadHeader) as caught:
        read_index(_patch(STREAM, fmt, at, value))
    assert caught.value.field == field and "nothing was decoded" in str(caught.value)


def test_truncated_and_extended_streams_are_refused() -> None:
    """A stream cut short (in the header, in a chunk) or with bytes after the last chunk is refused."""
    for cut in (0, 10, 31, 40, 100, len(STREAM) - 1):
        with pytest.raises(BadHeader):
            read_index(STREAM[:cut])
    with pytest.raises(BadHeader, match="1 bytes follow the last chunk"):
        read_index(STREAM + b"\0")


def test_a_coded_chunk_in_a_raw_stream_is_refused() -> None:
    """Mode CODED is refused in a stream whose dtype is raw."""
    raw = encode(bytes(600), "raw", 512)
    with pytest.raises(BadHeader, match="not one a raw stream takes"):
        read_index(_patch(raw, "<B", 32, 1))


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_after_the_magic_never_crash(tail: bytes) -> None:
    """Any bytes behind a valid magic and version are refused as a SqueezeError (or read), never another exception."""
    with contextlib.suppress(SqueezeError):
        read_index(b"TPSQ\x01\x00" + tail)


def test_the_stream_header_is_32_bytes_and_the_specs_are_named() -> None:
    """The header size is the documented 32 bytes; dtypes resolve by name, torch dtype, or fall back to raw."""
    assert STREAM_HEADER.size == 32
    assert spec_of("torch.bfloat16") is BF16 and spec_of("float16") is FP16 and spec_of("float32") is RAW
    assert read_stream_header(STREAM).spec is FP16


def test_sections_follow_each_other_4_aligned() -> None:
    """A coded chunk's sections lie in the documented order, the planes 4-byte aligned, the tail last."""
    where = sections(FP16, 1024 * 3 + 5, 40, 7)
    assert where.groups == 6 and where.codes == 20 and where.high == 20 + 160
    assert where.low == where.high + 4 * 8 * 3 * 6 and where.escaped == where.low + 256 * 6
    assert where.end == where.escaped + 7 + 5
