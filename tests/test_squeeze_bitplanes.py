"""Tests for torpor.allocator.squeeze.bitplanes: one word per bit of 32 values, only the planes below a group's width."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from torpor.allocator.squeeze.bitplanes import pack, unpack, words


@given(st.lists(st.integers(0, 8), min_size=1, max_size=5), st.integers(0, 2**32 - 1))
def test_pack_then_unpack_gives_the_codes(widths: list[int], seed: int) -> None:
    """Codes below 2**width per group come back from their planes; the planes take 8 words per width bit."""
    rng = np.random.default_rng(seed)
    w = np.array(widths, dtype=np.uint8)
    codes = (rng.integers(0, 256, (len(widths), 256)) % (1 << w.astype(np.int64))[:, None]).astype(np.uint16)
    packed = pack(codes, w, 8)
    assert packed.size == 4 * words(len(widths), w)
    assert (unpack(packed, w, 8) == codes).all()


def test_a_plane_word_holds_one_bit_of_32_lanes() -> None:
    """Word b of a lane block has bit i set where value i has bit b set (little-endian)."""
    codes = np.zeros((1, 256), dtype=np.uint16)
    codes[0, 3] = 0b10  # lane 3 of block 0, bit 1
    codes[0, 32 + 31] = 0b01  # lane 31 of block 1, bit 0
    planes = pack(codes, np.array([2], dtype=np.uint8), 8).view("<u4")
    assert planes[:4].tolist() == [0, 1 << 3, 1 << 31, 0]
