"""The squeezed-backup format on the GPU: encode, decode and sum64 of a CUDA tensor with the Triton kernels.

The same bytes as the numpy reference (:func:`~.encoder.encode`, :func:`~.decoder.decode`), bit
for bit (tests/test_squeeze_gpucodec.py). A backup is encoded in a few launches over all its
chunks at once: sum64, the per-group plan, a torch pass that sizes every chunk and chooses coded
or raw, one host round trip for those sizes (the headers are packed on the host), the pack and a
copy of the raw chunks and tails. Decode reads the chunk table from the host (the backup's
headers are checked there, :func:`~.layout.read_index`), checks each coded chunk's sections on
the GPU, unpacks, copies, and checks every chunk's sum64 over the restored bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton

from torpor.allocator.squeeze import kernels
from torpor.allocator.squeeze.faults import ChecksumMismatch, CorruptChunk
from torpor.allocator.squeeze.layout import (
    ALIGN,
    CHUNK_HEADER,
    CODED_MODE,
    DEFAULT_CHUNK,
    GROUP,
    RAW_MODE,
    STREAM_HEADER,
    ChunkHeader,
    ChunkRecord,
    Spec,
    StreamHeader,
    chunk_count,
    spec_of,
)

#: Words per sum64 program, groups per plan program, bytes per copy program.
SUM_WORDS = 1024
PLAN_GROUPS = 4
COPY_BLOCK = 4096


def sum64_gpu(data: torch.Tensor, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Every chunk's sum64 over the bytes of ``data`` (a contiguous CUDA tensor), as int64 (the u64's bits)."""
    src = data.reshape(-1).view(torch.uint8)
    length = src.numel()
    chunks = chunk_count(length, chunk_size)
    blocks = triton.cdiv(chunk_size // 4, SUM_WORDS)
    partial = torch.empty((max(chunks, 1), blocks), dtype=torch.int64, device=src.device)
    out = torch.empty(chunks, dtype=torch.int64, device=src.device)
    if chunks:
        kernels.sum64_partial[(chunks, blocks)](src, length, chunk_size, partial, blocks, WORDS=SUM_WORDS)
        kernels.sum64_finish[(chunks,)](partial, blocks, length, chunk_size, out, BLOCKS=64)
    return out


def _per_chunk(values: torch.Tensor, chunks: int, gpc: int) -> torch.Tensor:
    """Per-group values laid out (chunk, group in chunk) as int64, the short last chunk padded with zeros."""
    grid = torch.zeros(chunks * gpc, dtype=torch.int64, device=values.device)
    grid[: values.numel()] = values.to(torch.int64)
    return grid.reshape(chunks, gpc)


def _sections(spec: Spec, original: torch.Tensor, widths: torch.Tensor, escapes: torch.Tensor) -> torch.Tensor:
    """Per chunk (rows): groups, codes, high, low, escaped, tail, end; layout.sections on tensors."""
    groups = original // 2 // GROUP
    codes = (3 * groups + 3) // 4 * 4
    high = codes + 32 * widths.sum(dim=1)
    low = high + 32 * spec.high_bits * groups
    escaped = low + GROUP * groups
    tail = escaped + escapes.sum(dim=1)
    return torch.stack([groups, codes, high, low, escaped, tail, tail + original - 2 * GROUP * groups], dim=1)


def _exclusive(grid: torch.Tensor) -> torch.Tensor:
    return (grid.cumsum(dim=1) - grid).reshape(-1)


def _copy(src: torch.Tensor, dst: torch.Tensor, segments: Sequence[tuple[int, int, int]]) -> None:
    live = [s for s in segments if s[2] > 0]
    if live:
        table = torch.tensor(live, dtype=torch.int64, device=dst.device)
        grid = (len(live), triton.cdiv(max(s[2] for s in live), COPY_BLOCK))
        kernels.copy_segments[grid](src, dst, table, BLOCK=COPY_BLOCK)


def _info(coded: torch.Tensor, payload_at: torch.Tensor, where: torch.Tensor, gpc: int) -> torch.Tensor:
    first = torch.arange(coded.numel(), device=coded.device, dtype=torch.int64) * gpc
    cols = [coded.to(torch.int64), payload_at, *(where[:, i] for i in range(5)), first]
    return torch.stack(cols, dim=1).contiguous()


def encode_gpu(data: torch.Tensor, dtype: object = None, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """The squeezed stream of a contiguous CUDA tensor's bytes, as a uint8 CUDA tensor (``dtype``: default the tensor's)."""
    spec = spec_of(data.dtype if dtype is None else dtype)
    src = data.reshape(-1).view(torch.uint8)
    length, device = src.numel(), src.device
    chunks = chunk_count(length, chunk_size)
    gpc, groups = chunk_size // (2 * GROUP), length // 2 // GROUP
    starts = torch.arange(chunks, dtype=torch.int64, device=device) * chunk_size
    original = torch.clamp(length - starts, max=chunk_size)
    checks = sum64_gpu(src, chunk_size)
    zeros = torch.zeros((chunks, gpc), dtype=torch.int64, device=device)
    widths, escapes, where = zeros, zeros, _sections(spec, original, zeros, zeros)
    bases = widths8 = counts8 = torch.zeros(max(groups, 1), dtype=torch.uint8, device=device)
    coded = torch.zeros(chunks, dtype=torch.bool, device=device)
    if spec.codable and groups:
        src16 = src[: 2 * GROUP * groups].view(torch.int16)
        bases, widths8, counts8 = (torch.empty(groups, dtype=torch.uint8, device=device) for _ in range(3))
        grid = (triton.cdiv(groups, PLAN_GROUPS),)
        kernels.plan[grid](src16, groups, bases, widths8, counts8, spec.exponent_bits, spec.mantissa_bits, PLAN_GROUPS)
        widths, escapes = _per_chunk(widths8, chunks, gpc), _per_chunk(counts8, chunks, gpc)
        where = _sections(spec, original, widths, escapes)
        coded = (where[:, 0] > 0) & (where[:, 6] < original)
    payload = torch.where(coded, where[:, 6], original)
    record = CHUNK_HEADER.size + (payload + ALIGN - 1) // ALIGN * ALIGN
    payload_at = STREAM_HEADER.size + record.cumsum(0) - record + CHUNK_HEADER.size
    host = torch.stack(
        [
            coded.to(torch.int64),
            payload,
            torch.where(coded, escapes.sum(dim=1), 0),
            checks,
            payload_at,
            where[:, 5],
            original,
        ]
    )
    mode, sizes, esc, sums, at, tail_at, orig = host.cpu().numpy()
    total = STREAM_HEADER.size + int(record.sum().item()) if chunks else STREAM_HEADER.size
    out = torch.zeros(total, dtype=torch.uint8, device=device)
    if spec.codable and groups:
        info = _info(coded, payload_at, where[:, :5], gpc)
        kernels.pack[(groups,)](
            src16, bases, widths8, 8 * _exclusive(widths), _exclusive(escapes), info, out, out.view(torch.int32), gpc,
            spec.exponent_bits, spec.mantissa_bits, spec.high_bits,
        )  # fmt: skip
    segments = []
    for c in range(chunks):
        whole = 2 * GROUP * (int(orig[c]) // 2 // GROUP) if mode[c] else 0
        segments.append((c * chunk_size + whole, int(at[c] + (tail_at[c] if mode[c] else 0)), int(orig[c]) - whole))
    _copy(src, out, segments)
    heads = [StreamHeader(spec, chunk_size, length, chunks).pack()]
    places = [np.arange(STREAM_HEADER.size)]
    for c in range(chunks):
        kind = CODED_MODE if mode[c] else RAW_MODE
        sum64 = int(sums[c]) & ((1 << 64) - 1)
        heads.append(ChunkHeader(kind, int(orig[c]), int(sizes[c]), int(esc[c]), sum64).pack())
        places.append(np.arange(CHUNK_HEADER.size) + int(at[c]) - CHUNK_HEADER.size)
    index = torch.from_numpy(np.concatenate(places)).to(device)
    out[index] = torch.frombuffer(bytearray(b"".join(heads)), dtype=torch.uint8).to(device)
    return out


def decode_gpu(stream: torch.Tensor, head: StreamHeader, records: Sequence[ChunkRecord]) -> torch.Tensor:
    """The original bytes of a squeezed stream held in a CUDA uint8 tensor, every chunk checked on the GPU.

    ``head`` and ``records`` are the stream's, read on the host (:func:`~.layout.read_index`).
    A coded chunk whose sections do not add up raises CorruptChunk; a chunk whose restored bytes
    do not have the recorded sum64 raises ChecksumMismatch (the first such chunk, by index).
    """
    spec, chunk_size, length, device = head.spec, head.chunk_size, head.length, stream.device
    chunks, gpc, groups = len(records), chunk_size // (2 * GROUP), length // 2 // GROUP
    out = torch.empty(length + length % 2, dtype=torch.uint8, device=device)
    table = np.array([(r.header.mode, r.payload_at, r.header.original, r.header.escapes) for r in records])
    table = table.reshape(-1, 4).astype(np.int64)
    mode, payload_at, original, _ = (torch.from_numpy(col.copy()).to(device) for col in table.T)
    coded_host = table[:, 0] == CODED_MODE
    segments = [(r.payload_at, r.start, r.header.original) for r in records if r.header.mode == RAW_MODE]
    if coded_host.any():
        coded = mode == CODED_MODE
        g = torch.arange(groups, dtype=torch.int64, device=device)
        c = g // gpc
        ngroups = torch.where(coded, original // 2 // GROUP, 0)
        live = coded[c]
        last = stream.numel() - 1  # a header read on the host may still lie about its sections: read in bounds
        at = torch.where(live, payload_at[c] + ngroups[c] + g % gpc, 0)
        widths = _per_chunk(torch.where(live, stream[at.clamp(max=last)], 0), chunks, gpc)
        escapes = _per_chunk(torch.where(live, stream[(at + ngroups[c]).clamp(max=last)], 0), chunks, gpc)
        where = _sections(spec, original, widths, escapes)
        checks = torch.stack([where[:, 6], escapes.sum(dim=1), widths.amax(dim=1), where[:, 5]], dim=1).cpu().numpy()
        for r, (end, esc, widest, tail) in zip(records, checks, strict=True):
            if r.header.mode != CODED_MODE:
                continue
            fault = (
                f"a group's code width is {widest}, over {spec.exponent_bits} bits" if widest > spec.exponent_bits
                else f"its groups escape {esc} values, its header {r.header.escapes}" if esc != r.header.escapes
                else f"its sections end at byte {end}, its header says {r.header.payload}" if end != r.header.payload
                else ""
            )  # fmt: skip
            if fault:
                raise CorruptChunk(r.chunk, r.start, r.start + r.header.original, r.payload_at, fault)
            whole = 2 * GROUP * (r.header.original // 2 // GROUP)
            segments.append((r.payload_at + int(tail), r.start + whole, r.header.original - whole))
        info = _info(coded, payload_at, where[:, :5], gpc)
        kernels.unpack[(groups,)](
            stream, stream.view(torch.int32), 8 * _exclusive(widths), _exclusive(escapes), info,
            out[: 2 * GROUP * groups].view(torch.int16), gpc, spec.exponent_bits, spec.mantissa_bits, spec.high_bits,
        )  # fmt: skip
    _copy(stream, out, segments)
    restored = out[:length]
    found = sum64_gpu(restored, chunk_size).cpu().numpy().view(np.uint64)
    for r, sum64 in zip(records, found, strict=True):
        if int(sum64) != r.header.checksum:
            raise ChecksumMismatch(r.chunk, r.start, r.start + r.header.original, r.header.checksum, int(sum64))
    return restored


__all__ = ["decode_gpu", "encode_gpu", "sum64_gpu"]
