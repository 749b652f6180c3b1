"""Tests for torpor.allocator.squeeze.sum64: the chunk checksum against its documented formula."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torpor.allocator.squeeze.sum64 import sum64

M = (1 << 64) - 1


def _fmix(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M
    return k ^ (k >> 33)


def _formula(data: bytes, start: int) -> int:
    """sum64 written out one word at a time, as the module's docstring states it."""
    padded = data + bytes(-len(data) % 4)
    total = 0
    for j in range(len(padded) // 4):
        word = int.from_bytes(padded[4 * j : 4 * j + 4], "little")
        total += _fmix(word ^ (((start // 4 + j) * 0x9E3779B97F4A7C15) & M))
    return _fmix((total + len(data)) & M)


@given(st.binary(max_size=300), st.integers(0, 1 << 40).map(lambda n: 4 * n))
def test_sum64_is_the_documented_formula(data: bytes, start: int) -> None:
    """The vectorised sum64 equals the word-by-word formula for any bytes and any 4-aligned start."""
    assert sum64(np.frombuffer(data, dtype=np.uint8), start) == _formula(data, start)


@given(st.binary(min_size=1, max_size=200), st.data())
def test_any_one_changed_byte_changes_sum64(data: bytes, draw: st.DataObject) -> None:
    """Changing any one byte to any other value changes the checksum (each word's term is a bijection)."""
    at = draw.draw(st.integers(0, len(data) - 1))
    other = draw.draw(st.integers(0, 255).filter(lambda b: b != data[at]))
    changed = bytearray(data)
    changed[at] = other
    assert sum64(np.frombuffer(bytes(changed), dtype=np.uint8)) != sum64(np.frombuffer(data, dtype=np.uint8))


def test_position_and_length_count() -> None:
    """The same bytes at another offset, swapped words, or with a zero byte appended give other sums."""
    data = np.frombuffer(b"abcdefgh", dtype=np.uint8)
    assert sum64(data, 0) != sum64(data, 8)
    assert sum64(data) != sum64(np.frombuffer(b"efghabcd", dtype=np.uint8))
    assert sum64(data) != sum64(np.frombuffer(b"abcdefgh\0", dtype=np.uint8))


def test_an_unaligned_start_is_refused() -> None:
    """A start that is not a multiple of 4 is refused with the offset named."""
    with pytest.raises(ValueError, match="byte 6"):
        sum64(np.zeros(4, dtype=np.uint8), 6)
