"""The byte layout of a squeezed backup: the stream header, the chunk records, a coded chunk's sections.

A stream is a 32-byte header, then one record per chunk of ``chunk_size`` original bytes (the
last one shorter), in order; every integer is little-endian::

    stream header (32 bytes)   magic b"TPSQ" | version u16 | dtype u8 | reserved u8 (0)
                               | chunk_size u32 | reserved u32 (0) | length u64 | chunks u64
    chunk record               header (24 bytes) | payload | zero padding to a multiple of 8
    chunk header (24 bytes)    mode u8 | reserved u8, u16 (0) | original bytes u32
                               | payload bytes u32 | escapes u32 | sum64 u64

``mode`` is RAW (the payload is the original bytes) or CODED (the sections below; only for a
16-bit float ``dtype``, and only when it is smaller than the original). A coded chunk of ``n``
original bytes holds ``G = (n // 2) // 256`` groups of 256 values; for each value the exponent
field ``e`` is coded, the sign and mantissa (``rest``, 8 bits for bf16, 11 for fp16) are stored
as they are. Its payload, offsets from the payload's start::

    bases     G bytes           a group's largest exponent
    widths    G bytes           bits per exponent code in the group, 0..exponent bits
    escapes   G bytes           how many of the group's values escaped (0..255)
    (zero padding to a multiple of 4)
    codes     8 * sum(widths) words   per group, per 32-value lane block, ``width`` bit-planes:
                                      word bit i = bit b of value i's code (little-endian u32)
    rest-high 8 * HIGH * G words      the bits of ``rest`` above its low 8, as bit-planes (fp16: 3)
    rest-low  256 * G bytes           the low 8 bits of each value's ``rest``
    escaped   escapes bytes           each escaped value's exponent, in value order
    tail      n - 512 * G bytes       the bytes after the last whole group, as they are

A code is ``base - e``; the all-ones code of a width (``2**width - 1``) is the escape: the
exponent is the next byte of ``escaped``. Width 0 says every exponent of the group is ``base``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import NamedTuple

from torpor.allocator.squeeze.faults import BadHeader

MAGIC = b"TPSQ"
VERSION = 1
STREAM_HEADER = struct.Struct("<4sHBBIIQQ")
CHUNK_HEADER = struct.Struct("<BBHIIIQ")
#: Values per group (a group shares one base exponent and one code width).
GROUP = 256
#: Values per lane block: one bit-plane word holds one bit of 32 values.
LANES = 32
#: A chunk record's payload is padded to this many bytes, so every record starts 8-aligned.
ALIGN = 8
#: The chunk sizes the format takes: whole groups of 16-bit values, at most 1 GiB.
MIN_CHUNK = 2 * GROUP
MAX_CHUNK = 1 << 30
#: The default chunk: 1 MiB of original bytes.
DEFAULT_CHUNK = 1 << 20

RAW_MODE = 0
CODED_MODE = 1


@dataclass(frozen=True)
class Spec:
    """A dtype the format codes: its code, its name, its exponent and mantissa bits (16-bit floats only)."""

    code: int
    name: str
    exponent_bits: int
    mantissa_bits: int

    @property
    def high_bits(self) -> int:
        """The bits of ``rest`` (sign and mantissa) above its low 8, stored as bit-planes."""
        return max(0, self.mantissa_bits + 1 - 8)

    @property
    def codable(self) -> bool:
        """Whether chunks of this dtype may be coded (RAW is never)."""
        return self.exponent_bits > 0


RAW = Spec(0, "raw", 0, 0)
BF16 = Spec(1, "bfloat16", 8, 7)
FP16 = Spec(2, "float16", 5, 10)
SPECS = {s.code: s for s in (RAW, BF16, FP16)}
BY_NAME = {s.name: s for s in SPECS.values()} | {"bf16": BF16, "fp16": FP16, "half": FP16}


def spec_of(dtype: object) -> Spec:
    """The Spec for a dtype given by name (``"bfloat16"``), a torch or numpy dtype; any other dtype is RAW."""
    if isinstance(dtype, Spec):
        return dtype
    name = str(dtype).removeprefix("torch.")
    return BY_NAME.get(name, RAW)


def align(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


class StreamHeader(NamedTuple):
    """The stream header's fields."""

    spec: Spec
    chunk_size: int
    length: int
    chunks: int

    def pack(self) -> bytes:
        """The header's 32 bytes."""
        return STREAM_HEADER.pack(MAGIC, VERSION, self.spec.code, 0, self.chunk_size, 0, self.length, self.chunks)


class ChunkHeader(NamedTuple):
    """A chunk header's fields."""

    mode: int
    original: int
    payload: int
    escapes: int
    checksum: int

    def pack(self) -> bytes:
        """The header's 24 bytes."""
        return CHUNK_HEADER.pack(self.mode, 0, 0, self.original, self.payload, self.escapes, self.checksum)


class Sections(NamedTuple):
    """Where each section of a coded chunk's payload begins (bytes from the payload's start), and its end."""

    groups: int
    codes: int
    high: int
    low: int
    escaped: int
    tail: int
    end: int


def sections(spec: Spec, original: int, code_words: int, escapes: int) -> Sections:
    """The section offsets of a coded chunk of ``original`` bytes with ``code_words`` code words and ``escapes``."""
    groups = original // 2 // GROUP
    codes = align(3 * groups, 4)
    high = codes + 4 * code_words
    low = high + 4 * (GROUP // LANES) * spec.high_bits * groups
    escaped = low + GROUP * groups
    tail = escaped + escapes
    return Sections(groups, codes, high, low, escaped, tail, tail + original - 2 * GROUP * groups)


def chunk_count(length: int, chunk_size: int) -> int:
    """How many chunks a backup of ``length`` bytes has."""
    return -(-length // chunk_size)


def read_stream_header(stream: bytes | memoryview) -> StreamHeader:
    """The stream header of ``stream``, every field checked (BadHeader names the one refused)."""
    if len(stream) < STREAM_HEADER.size:
        raise BadHeader(0, "length", f"is {len(stream)} bytes, shorter than the {STREAM_HEADER.size}-byte header")
    magic, version, dtype, reserved, chunk_size, reserved2, length, chunks = STREAM_HEADER.unpack_from(stream, 0)
    if magic != MAGIC:
        raise BadHeader(0, "magic", f"is {bytes(magic)!r}, not {MAGIC!r}: not a squeezed backup")
    if version != VERSION:
        raise BadHeader(4, "version", f"is {version}; this torpor reads version {VERSION}")
    if dtype not in SPECS:
        raise BadHeader(6, "dtype", f"code {dtype} is unknown (known: {sorted(SPECS)})")
    if reserved or reserved2:
        raise BadHeader(7, "reserved", "fields are not zero")
    if not (MIN_CHUNK <= chunk_size <= MAX_CHUNK and chunk_size % MIN_CHUNK == 0):
        raise BadHeader(8, "chunk_size", f"{chunk_size} is not a multiple of {MIN_CHUNK} in {MIN_CHUNK}..{MAX_CHUNK}")
    if chunks != chunk_count(length, chunk_size):
        reason = f"{chunks} does not cover {length} bytes in chunks of {chunk_size}"
        raise BadHeader(24, "chunks", reason)
    return StreamHeader(SPECS[dtype], chunk_size, length, chunks)


class ChunkRecord(NamedTuple):
    """One chunk's place: its number, header, where its payload lies in the stream, the original bytes it covers."""

    chunk: int
    header: ChunkHeader
    payload_at: int
    start: int


def read_index(stream: bytes | memoryview) -> tuple[StreamHeader, list[ChunkRecord]]:
    """The stream header and every chunk's record, each length checked against the stream's (BadHeader)."""
    head = read_stream_header(stream)
    records: list[ChunkRecord] = []
    at = STREAM_HEADER.size
    for index in range(head.chunks):
        if at + CHUNK_HEADER.size > len(stream):
            raise BadHeader(at, "chunk header", f"runs past the stream's end ({len(stream)} bytes)", index)
        mode, r1, r2, original, payload, escapes, checksum = CHUNK_HEADER.unpack_from(stream, at)
        start = index * head.chunk_size
        expected = min(head.chunk_size, head.length - start)
        if r1 or r2:
            raise BadHeader(at + 1, "reserved", "fields are not zero", index)
        if original != expected:
            raise BadHeader(at + 4, "original bytes", f"is {original}, the stream header says {expected}", index)
        if mode == RAW_MODE:
            if payload != original or escapes:
                raise BadHeader(at + 8, "payload bytes", f"is {payload} for a raw chunk of {original}", index)
        elif mode == CODED_MODE and head.spec.codable:
            if payload >= original or escapes > original // 2:
                reason = f"is {payload} with {escapes} escapes for a coded chunk of {original}"
                raise BadHeader(at + 8, "payload bytes", reason, index)
        else:
            raise BadHeader(at, "mode", f"{mode} is not one a {head.spec.name} stream takes", index)
        payload_at = at + CHUNK_HEADER.size
        at = payload_at + align(payload, ALIGN)
        if at > len(stream):
            raise BadHeader(payload_at, "payload bytes", f"{payload} run past the stream's end", index)
        if any(stream[payload_at + payload : at]):
            raise BadHeader(payload_at + payload, "padding", "is not zero", index)
        records.append(ChunkRecord(index, ChunkHeader(mode, original, payload, escapes, checksum), payload_at, start))
    if at != len(stream):
        raise BadHeader(at, "length", f"{len(stream) - at} bytes follow the last chunk")
    return head, records


__all__ = [
    "BF16",
    "DEFAULT_CHUNK",
    "FP16",
    "RAW",
    "ChunkHeader",
    "ChunkRecord",
    "Sections",
    "Spec",
    "StreamHeader",
    "read_index",
    "sections",
    "spec_of",
]
