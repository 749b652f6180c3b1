"""sum64: the checksum every chunk of a squeezed backup carries, over its original bytes (numpy reference).

The bytes are read as little-endian 32-bit words ``w[j]`` (the last one zero-padded), each keyed
by its word index in the whole backup ``i = start / 4 + j`` and mixed by MurmurHash3's 64-bit
finalizer; the terms are summed modulo 2**64 and the sum finalized with the byte count::

    term(j) = fmix64(w[j] XOR (i * 0x9E3779B97F4A7C15 mod 2**64))
    sum64   = fmix64((sum_j term(j) + nbytes) mod 2**64)

Why this one: a sum of independent terms reduces in any order, so a GPU computes it in one
pass over the bytes in parallel and gets the CPU's value bit for bit (CRC32C is serial per
byte and needs tables); ``fmix64`` is a bijection and so is the XOR with the key, so a change
of any one word changes its term and the sum: a flipped byte is always caught. The key makes
word order and position count (a swapped pair of chunks or words is caught unless two 64-bit
mixes collide, about 2**-64). It is a check against damage, not against an adversary.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from torpor.errors import BadArgument

MASK64 = (1 << 64) - 1
#: The key multiplier: 2**64 / golden ratio, odd.
KEY = 0x9E3779B97F4A7C15
#: MurmurHash3's fmix64 multipliers.
MIX1 = 0xFF51AFD7ED558CCD
MIX2 = 0xC4CEB9FE1A85EC53


def fmix64_int(k: int) -> int:
    """MurmurHash3's 64-bit finalizer on one Python int (taken modulo 2**64)."""
    k &= MASK64
    k ^= k >> 33
    k = (k * MIX1) & MASK64
    k ^= k >> 33
    k = (k * MIX2) & MASK64
    return k ^ (k >> 33)


def fmix64(k: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """MurmurHash3's 64-bit finalizer, element-wise (uint64 arithmetic wraps modulo 2**64)."""
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(MIX1)
    k = k ^ (k >> np.uint64(33))
    k = k * np.uint64(MIX2)
    return k ^ (k >> np.uint64(33))


def sum64(data: npt.NDArray[np.uint8], start: int = 0) -> int:
    """The sum64 of ``data``, which begins at byte ``start`` (a multiple of 4) of the backup."""
    if start % 4:
        msg = f"sum64 refused: a chunk starts at byte {start}, not a multiple of 4"
        raise BadArgument(msg)
    n = int(data.size)
    padded = np.zeros((n + 3) // 4 * 4, dtype=np.uint8)
    padded[:n] = data
    words = padded.view("<u4").astype(np.uint64)
    index = np.arange(words.size, dtype=np.uint64) + np.uint64(start // 4)
    total = int(fmix64(words ^ (index * np.uint64(KEY))).sum(dtype=np.uint64))
    return fmix64_int(total + n)


__all__ = ["sum64"]
