"""The squeezed-backup encoder (numpy reference): bytes in, a stream of chunk records out.

Every chunk is coded when its dtype is a 16-bit float and the coded payload is smaller than the
chunk; otherwise it is stored raw, so an incompressible chunk costs its 24-byte header and at
most 7 bytes of padding. Each chunk header carries the sum64 of the chunk's original bytes.
The byte layout is :mod:`torpor.allocator.squeeze.layout`'s; the GPU encoder writes the same bytes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from torpor.allocator.squeeze import bitplanes, exponents
from torpor.allocator.squeeze.layout import (
    ALIGN,
    CODED_MODE,
    DEFAULT_CHUNK,
    GROUP,
    MAX_CHUNK,
    MIN_CHUNK,
    RAW_MODE,
    ChunkHeader,
    Spec,
    StreamHeader,
    align,
    chunk_count,
    sections,
    spec_of,
)
from torpor.allocator.squeeze.sum64 import sum64
from torpor.errors import BadArgument

Bytes = npt.NDArray[np.uint8]


def as_bytes(data: bytes | bytearray | memoryview | npt.NDArray[np.generic]) -> Bytes:
    """``data``'s bytes as a flat uint8 array (no copy where it can be a view)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def coded_payload(chunk: Bytes, spec: Spec) -> tuple[bytes, int] | None:
    """A coded chunk's payload and its escape count, or None where coding does not make it smaller."""
    groups = chunk.size // 2 // GROUP
    if not spec.codable or groups == 0:
        return None
    whole = 2 * GROUP * groups
    values = chunk[:whole].view("<u2").reshape(groups, GROUP)
    fields = exponents.split(values, spec)
    coding = exponents.choose(fields.exponent, spec)
    escapes = int(coding.escaped.sum())
    where = sections(spec, chunk.size, bitplanes.words(groups, coding.widths), escapes)
    if where.end >= chunk.size:
        return None
    out = np.zeros(where.end, dtype=np.uint8)
    out[:groups] = coding.bases
    out[groups : 2 * groups] = coding.widths
    out[2 * groups : 3 * groups] = coding.escaped.sum(axis=1)
    out[where.codes : where.high] = bitplanes.pack(coding.codes, coding.widths, spec.exponent_bits)
    high = (fields.rest >> np.uint16(8)).astype(np.uint16)
    all_high = np.full(groups, spec.high_bits, dtype=np.uint8)
    out[where.high : where.low] = bitplanes.pack(high, all_high, spec.high_bits)
    out[where.low : where.escaped] = (fields.rest & np.uint16(0xFF)).astype(np.uint8).reshape(-1)
    out[where.escaped : where.tail] = fields.exponent[coding.escaped].astype(np.uint8)
    out[where.tail :] = chunk[whole:]
    return out.tobytes(), escapes


def encode_chunk(chunk: Bytes, start: int, spec: Spec) -> bytes:
    """One chunk's record (header, payload, padding) for the chunk of original bytes at ``start``."""
    checksum = sum64(chunk, start)
    coded = coded_payload(chunk, spec)
    if coded is None:
        header = ChunkHeader(RAW_MODE, chunk.size, chunk.size, 0, checksum)
        payload = chunk.tobytes()
    else:
        payload, escapes = coded
        header = ChunkHeader(CODED_MODE, chunk.size, len(payload), escapes, checksum)
    return header.pack() + payload + bytes(align(len(payload), ALIGN) - len(payload))


def check_chunk_size(chunk_size: int) -> None:
    """Refuse a chunk size the format does not take (ValueError naming the allowed ones)."""
    if not (MIN_CHUNK <= chunk_size <= MAX_CHUNK and chunk_size % MIN_CHUNK == 0):
        msg = f"chunk size {chunk_size} refused: it must be a multiple of {MIN_CHUNK} bytes in {MIN_CHUNK}..{MAX_CHUNK}"
        raise BadArgument(msg)


def encode(
    data: bytes | bytearray | memoryview | npt.NDArray[np.generic],
    dtype: object = "raw",
    chunk_size: int = DEFAULT_CHUNK,
) -> bytes:
    """The squeezed stream of ``data`` (any length), coded as ``dtype`` (a name, torch or numpy dtype; others raw)."""
    check_chunk_size(chunk_size)
    spec = spec_of(dtype)
    flat = as_bytes(data)
    chunks = chunk_count(flat.size, chunk_size)
    parts = [StreamHeader(spec, chunk_size, int(flat.size), chunks).pack()]
    for index in range(chunks):
        start = index * chunk_size
        parts.append(encode_chunk(flat[start : start + chunk_size], start, spec))
    return b"".join(parts)


__all__ = ["as_bytes", "check_chunk_size", "encode", "encode_chunk"]
