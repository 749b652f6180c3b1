"""torpor.allocator.squeeze: a lossless chunked format for backups of bf16 and fp16 tensors, every chunk checksummed.

The foundation of issue 53's codec, not yet in the sleep/wake path (docs/compression.md says
what is and is not built). A backup is split into chunks (1 MiB by default); a chunk of a 16-bit
float dtype is split into fields, its exponents coded per group of 256 values (a base and
fixed-width codes with an escape), sign and mantissa stored as they are; a chunk that would not
shrink, and every chunk of another dtype, is stored raw. Each chunk carries the sum64 of its
original bytes (:mod:`.sum64`), checked at decode. The byte layout is :mod:`.layout`'s.

Its modules, lowest first: :mod:`.faults` (the errors), :mod:`.sum64`, :mod:`.layout`,
:mod:`.bitplanes`, :mod:`.exponents`, :mod:`.encoder`, :mod:`.decoder` (the numpy reference the
simulated device runs and the GPU kernels are checked against), and :mod:`.gpucodec` with
:mod:`.kernels` (the Triton kernels; they import torch and triton, so this facade does not).
The names are internal until the codec is in the sleep/wake path: torpor's facade exports none.
"""

from __future__ import annotations

from torpor.allocator.squeeze.decoder import Verified, decode, verify
from torpor.allocator.squeeze.encoder import encode
from torpor.allocator.squeeze.faults import BadHeader, ChecksumMismatch, CorruptChunk, SqueezeError
from torpor.allocator.squeeze.layout import DEFAULT_CHUNK, read_index, spec_of
from torpor.allocator.squeeze.sum64 import sum64

__all__ = [
    "DEFAULT_CHUNK",
    "BadHeader",
    "ChecksumMismatch",
    "CorruptChunk",
    "SqueezeError",
    "Verified",
    "decode",
    "encode",
    "read_index",
    "spec_of",
    "sum64",
    "verify",
]
