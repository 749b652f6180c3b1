"""The squeezed-backup decoder and verifier (numpy reference): a stream in, the original bytes out, every chunk checked.

Every length is read from the stream and checked before it is used (:func:`~.layout.read_index`
for the headers, :func:`decode_chunk` for a coded payload's sections), so a damaged stream is
refused with a :class:`~.faults.SqueezeError` naming where, never read past its end; every chunk's
restored bytes are checked against the sum64 its header recorded (:class:`~.faults.ChecksumMismatch`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from torpor.allocator.squeeze import bitplanes, exponents
from torpor.allocator.squeeze.encoder import as_bytes
from torpor.allocator.squeeze.faults import ChecksumMismatch, CorruptChunk
from torpor.allocator.squeeze.layout import GROUP, RAW_MODE, ChunkRecord, Spec, read_index, sections
from torpor.allocator.squeeze.sum64 import sum64

Bytes = npt.NDArray[np.uint8]


class Verified(NamedTuple):
    """What a verified stream held: its dtype, original bytes, chunks, coded chunks and stream bytes."""

    dtype: str
    length: int
    chunks: int
    coded: int
    stream_bytes: int

    @property
    def ratio(self) -> float:
        """Stream bytes over original bytes (1.0 for an empty backup)."""
        return self.stream_bytes / self.length if self.length else 1.0


def _corrupt(record: ChunkRecord, reason: str) -> CorruptChunk:
    end = record.start + record.header.original
    return CorruptChunk(record.chunk, record.start, end, record.payload_at, reason)


def decode_coded(payload: Bytes, record: ChunkRecord, spec: Spec) -> Bytes:
    """A coded chunk's original bytes from its payload (CorruptChunk where its sections do not hold together)."""
    original = record.header.original
    groups = original // 2 // GROUP
    bases, widths = payload[:groups], payload[groups : 2 * groups]
    counts = payload[2 * groups : 3 * groups].astype(np.int64)
    if groups and int(widths.max()) > spec.exponent_bits:
        raise _corrupt(record, f"a group's code width is {int(widths.max())}, over {spec.exponent_bits} bits")
    if int(counts.sum()) != record.header.escapes:
        raise _corrupt(record, f"its groups escape {int(counts.sum())} values, its header {record.header.escapes}")
    where = sections(spec, original, bitplanes.words(groups, widths), record.header.escapes)
    if where.end != record.header.payload:
        raise _corrupt(record, f"its sections end at byte {where.end}, its header says {record.header.payload}")
    if any(payload[3 * groups : where.codes]):
        raise _corrupt(record, "the padding after its group headers is not zero")
    codes = bitplanes.unpack(payload[where.codes : where.high], widths, spec.exponent_bits)
    top = ((np.uint16(1) << widths.astype(np.uint16)) - np.uint16(1))[:, None]
    escaped = (widths[:, None] > 0) & (codes == top)
    found = escaped.sum(axis=1)
    if (found != counts).any():
        group = int(np.flatnonzero(found != counts)[0])
        raise _corrupt(record, f"group {group} holds {int(found[group])} escape codes, its count says {counts[group]}")
    exponent = bases.astype(np.uint16)[:, None] - codes
    exponent[escaped] = payload[where.escaped : where.tail]
    all_high = np.full(groups, spec.high_bits, dtype=np.uint8)
    high = bitplanes.unpack(payload[where.high : where.low], all_high, spec.high_bits)
    rest = (high << np.uint16(8)) | payload[where.low : where.escaped].reshape(groups, GROUP).astype(np.uint16)
    values = exponents.join(exponents.Fields(exponent, rest), spec).astype("<u2")
    return np.concatenate([values.reshape(-1).view(np.uint8), payload[where.tail : where.end]])


def decode_chunk(stream: Bytes, record: ChunkRecord, spec: Spec) -> Bytes:
    """One chunk's original bytes, checked against its sum64 (ChecksumMismatch, CorruptChunk)."""
    payload = stream[record.payload_at : record.payload_at + record.header.payload]
    data = payload if record.header.mode == RAW_MODE else decode_coded(payload, record, spec)
    found = sum64(data, record.start)
    if found != record.header.checksum:
        end = record.start + record.header.original
        raise ChecksumMismatch(record.chunk, record.start, end, record.header.checksum, found)
    return data


def decode(stream: bytes | bytearray | memoryview | Bytes) -> bytes:
    """The original bytes of a squeezed stream, every chunk checked (a SqueezeError subclass where one is not)."""
    flat = as_bytes(stream)
    head, records = read_index(flat.data)
    out = np.empty(head.length, dtype=np.uint8)
    for record in records:
        out[record.start : record.start + record.header.original] = decode_chunk(flat, record, head.spec)
    return out.tobytes()


def verify(stream: bytes | bytearray | memoryview | Bytes) -> Verified:
    """Decode every chunk and check it, keeping nothing: what the stream holds, or the SqueezeError of its first bad chunk."""
    flat = as_bytes(stream)
    head, records = read_index(flat.data)
    for record in records:
        decode_chunk(flat, record, head.spec)
    coded = sum(1 for r in records if r.header.mode != RAW_MODE)
    return Verified(head.spec.name, head.length, head.chunks, coded, int(flat.size))


__all__ = ["Verified", "decode", "decode_chunk", "verify"]
