# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels are untyped: their arguments are pointers and constexprs that triton.jit types at launch.)
"""The Triton kernels of the squeezed-backup format: sum64, the per-group plan, pack, unpack, segment copy.

Each does on the GPU what the numpy reference does on the CPU (:mod:`.sum64`, :mod:`.exponents`,
:mod:`.bitplanes`, :mod:`.encoder`, :mod:`.decoder`), writing the same bytes; :mod:`.gpucodec`
launches them. 16-bit values are read as int16 and widened (``& 0xFFFF``). A chunk's facts reach
the pack and unpack kernels as one row of ``INFO`` int64 fields per chunk (:data:`INFO_FIELDS`).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: A chunk's row in the chunk table the pack and unpack kernels read.
INFO_FIELDS = ("coded", "payload_at", "groups", "codes_at", "high_at", "low_at", "escaped_at", "first_group")
INFO = len(INFO_FIELDS)
#: sum64's key multiplier and fmix64's multipliers (:mod:`.sum64`), as constants a kernel may read.
KEY = tl.constexpr(0x9E3779B97F4A7C15)
MIX1 = tl.constexpr(0xFF51AFD7ED558CCD)
MIX2 = tl.constexpr(0xC4CEB9FE1A85EC53)


@triton.jit
def _fmix64(k):
    k = k ^ (k >> 33)
    k = k * MIX1
    k = k ^ (k >> 33)
    k = k * MIX2
    return k ^ (k >> 33)


@triton.jit
def sum64_partial(src, length, chunk_size, partial, blocks, WORDS: tl.constexpr):
    """Program (chunk c, block k): the sum of sum64's terms over WORDS words of chunk c, into partial[c, k]."""
    c = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    start = c * chunk_size
    n = tl.minimum(chunk_size, length - start)
    j = k * WORDS + tl.arange(0, WORDS).to(tl.int64)
    byte = 4 * j[:, None] + tl.arange(0, 4)[None, :]
    raw = tl.load(src + start + byte, mask=byte < n, other=0).to(tl.uint64)
    word = tl.sum(raw << (8 * tl.arange(0, 4)[None, :]).to(tl.uint64), axis=1)
    index = (start // 4 + j).to(tl.uint64)
    term = _fmix64(word ^ (index * KEY))
    term = tl.where(4 * j < n, term, 0)
    tl.store(partial + c * blocks + k, tl.sum(term, axis=0).to(tl.int64, bitcast=True))


@triton.jit
def sum64_finish(partial, blocks, length, chunk_size, out, BLOCKS: tl.constexpr):
    """Program c: chunk c's sum64 from its partial sums and its byte count, into out[c]."""
    c = tl.program_id(0).to(tl.int64)
    total = tl.zeros([BLOCKS], tl.uint64)
    for first in range(0, blocks, BLOCKS):
        k = first + tl.arange(0, BLOCKS)
        total += tl.load(partial + c * blocks + k, mask=k < blocks, other=0).to(tl.uint64, bitcast=True)
    n = tl.minimum(chunk_size, length - c * chunk_size).to(tl.uint64)
    tl.store(out + c, _fmix64(tl.sum(total, axis=0) + n).to(tl.int64, bitcast=True))


@triton.jit
def plan(src, groups, bases, widths, escapes, E: tl.constexpr, M: tl.constexpr, GPB: tl.constexpr):
    """Program p: for GPB groups of 256 values, the base, the cheapest width and the escape count (exponents.choose)."""
    g = tl.program_id(0).to(tl.int64) * GPB + tl.arange(0, GPB)
    ok = g < groups
    v = tl.load(src + g[:, None] * 256 + tl.arange(0, 256)[None, :], mask=ok[:, None], other=0).to(tl.int32) & 0xFFFF
    e = (v >> M) & ((1 << E) - 1)
    base = tl.max(e, axis=1)
    off = base[:, None] - e
    best = tl.where(tl.max(off, axis=1) == 0, 0, 1 << 30)
    width = tl.zeros([GPB], tl.int32)
    for w in tl.static_range(1, E + 1):
        esc = tl.sum((off >= (1 << w) - 1).to(tl.int32), axis=1)
        cost = tl.where(esc <= 255, 256 * w + 8 * esc, 1 << 30)
        better = cost < best
        best = tl.where(better, cost, best)
        width = tl.where(better, w, width)
    top = (1 << width) - 1
    count = tl.sum(((width[:, None] > 0) & (off >= top[:, None])).to(tl.int32), axis=1)
    tl.store(bases + g, base.to(tl.uint8), mask=ok)
    tl.store(widths + g, width.to(tl.uint8), mask=ok)
    tl.store(escapes + g, count.to(tl.uint8), mask=ok)


@triton.jit
def _planes(out32, at, code, lane, ok, stride, PLANES: tl.constexpr):
    """Store the bit-planes of ``code`` ([8 blocks, 32 lanes]) below ``ok``'s planes: word (block s, plane b) at at + s*stride + b."""
    blocks = tl.arange(0, 8).to(tl.int64)
    for b in tl.static_range(PLANES):
        word = tl.sum(((code >> b) & 1).to(tl.uint32) << lane.to(tl.uint32), axis=1)
        tl.store(out32 + at + blocks * stride + b, word.to(tl.int32, bitcast=True), mask=ok & (b < stride))


@triton.jit
def _unplanes(src32, at, lane, ok, stride, PLANES: tl.constexpr):
    """The codes ([8 blocks, 32 lanes]) whose bit-planes lie at at + s*stride + b, b below ``stride`` (others 0)."""
    blocks = tl.arange(0, 8).to(tl.int64)
    code = tl.zeros([8, 32], tl.int32)
    for b in tl.static_range(PLANES):
        word = tl.load(src32 + at + blocks * stride + b, mask=ok & (b < stride), other=0)
        code |= ((word[:, None] >> lane) & 1) << b
    return code


@triton.jit
def pack(src, bases, widths, group_words, group_escapes, info, out8, out32, gpc,
         E: tl.constexpr, M: tl.constexpr, H: tl.constexpr):  # fmt: skip
    """Program g: group g's header bytes, code planes, rest planes and bytes, escapes, into its coded chunk's payload."""
    g = tl.program_id(0).to(tl.int64)
    row = info + (g // gpc) * 8
    ok = tl.load(row) != 0
    payload, ngroups = tl.load(row + 1), tl.load(row + 2)
    gi = g - tl.load(row + 7)
    lane = tl.arange(0, 32)[None, :]
    value = tl.arange(0, 8)[:, None] * 32 + lane
    v = tl.load(src + g * 256 + value, mask=ok).to(tl.int32) & 0xFFFF
    e = (v >> M) & ((1 << E) - 1)
    base = tl.load(bases + g).to(tl.int32)
    w = tl.load(widths + g).to(tl.int32)
    top = (1 << w) - 1
    esc = (w > 0) & (base - e >= top)
    code = tl.where(esc, top, base - e)
    _planes(out32, (payload + tl.load(row + 3)) // 4 + tl.load(group_words + g), code, lane, ok, w, E)
    rest = ((v >> 15) << M) | (v & ((1 << M) - 1))
    if H > 0:
        _planes(out32, (payload + tl.load(row + 4)) // 4 + gi * 8 * H, rest >> 8, lane, ok, H, H)
    tl.store(out8 + payload + tl.load(row + 5) + gi * 256 + value, (rest & 0xFF).to(tl.uint8), mask=ok)
    flags = esc.to(tl.int32)
    per_block = tl.sum(flags, axis=1)
    rank = tl.cumsum(flags, axis=1) - flags + (tl.cumsum(per_block, axis=0) - per_block)[:, None]
    at = payload + tl.load(row + 6) + tl.load(group_escapes + g)
    tl.store(out8 + at + rank, e.to(tl.uint8), mask=ok & esc)
    tl.store(out8 + payload + gi, base.to(tl.uint8), mask=ok)
    tl.store(out8 + payload + ngroups + gi, w.to(tl.uint8), mask=ok)
    tl.store(out8 + payload + 2 * ngroups + gi, tl.sum(per_block, axis=0).to(tl.uint8), mask=ok)


@triton.jit
def unpack(stream8, stream32, group_words, group_escapes, info, out, gpc,
           E: tl.constexpr, M: tl.constexpr, H: tl.constexpr):  # fmt: skip
    """Program g: group g's 256 values rebuilt from its coded chunk's payload, into out (int16) at g * 256."""
    g = tl.program_id(0).to(tl.int64)
    row = info + (g // gpc) * 8
    ok = tl.load(row) != 0
    payload, ngroups = tl.load(row + 1), tl.load(row + 2)
    gi = g - tl.load(row + 7)
    lane = tl.arange(0, 32)[None, :]
    value = tl.arange(0, 8)[:, None] * 32 + lane
    base = tl.load(stream8 + payload + gi, mask=ok, other=0).to(tl.int32)
    w = tl.load(stream8 + payload + ngroups + gi, mask=ok, other=0).to(tl.int32)
    count = tl.load(stream8 + payload + 2 * ngroups + gi, mask=ok, other=0).to(tl.int32)
    code = _unplanes(stream32, (payload + tl.load(row + 3)) // 4 + tl.load(group_words + g), lane, ok, w, E)
    top = (1 << w) - 1
    esc = (w > 0) & (code == top)
    flags = esc.to(tl.int32)
    per_block = tl.sum(flags, axis=1)
    rank = tl.cumsum(flags, axis=1) - flags + (tl.cumsum(per_block, axis=0) - per_block)[:, None]
    at = payload + tl.load(row + 6) + tl.load(group_escapes + g)
    escaped = tl.load(stream8 + at + rank, mask=ok & esc & (rank < count), other=0).to(tl.int32)
    e = tl.where(esc, escaped, base - code) & ((1 << E) - 1)
    rest = tl.load(stream8 + payload + tl.load(row + 5) + gi * 256 + value, mask=ok, other=0).to(tl.int32)
    if H > 0:
        rest |= _unplanes(stream32, (payload + tl.load(row + 4)) // 4 + gi * 8 * H, lane, ok, H, H) << 8
    v = (((rest >> M) & 1) << 15) | (e << M) | (rest & ((1 << M) - 1))
    tl.store(out + g * 256 + value, v.to(tl.int16), mask=ok)


@triton.jit
def copy_segments(src, dst, segments, BLOCK: tl.constexpr):
    """Program (segment s, block k): bytes k*BLOCK.. of segment s (src offset, dst offset, length) copied."""
    s = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    src_at, dst_at, n = tl.load(segments + 3 * s), tl.load(segments + 3 * s + 1), tl.load(segments + 3 * s + 2)
    o = k * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + dst_at + o, tl.load(src + src_at + o, mask=o < n), mask=o < n)


__all__ = ["INFO", "INFO_FIELDS", "copy_segments", "pack", "plan", "sum64_finish", "sum64_partial", "unpack"]
