"""Tests for torpor.allocator.squeeze.exponents: fields split and joined exactly, and the cheapest code width chosen."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from torpor.allocator.squeeze.exponents import choose, join, split
from torpor.allocator.squeeze.layout import BF16, FP16, Spec


@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=64), st.sampled_from([BF16, FP16]))
def test_split_then_join_is_the_identity(words: list[int], spec: Spec) -> None:
    """Every 16-bit word, NaN and infinity patterns included, is rebuilt from its exponent and rest."""
    values = np.array(words, dtype=np.uint16)
    assert (join(split(values, spec), spec) == values).all()


def _cost(offsets: np.ndarray, w: int) -> int:
    if w == 0:
        return 0 if (offsets == 0).all() else 1 << 60
    escapes = int((offsets >= (1 << w) - 1).sum())
    return 256 * w + 8 * escapes if escapes <= 255 else 1 << 60


@given(st.integers(0, 2**32 - 1), st.integers(0, 8))
def test_the_width_chosen_is_the_cheapest_and_smallest(seed: int, spread: int) -> None:
    """Each group's width costs no more than any other width, ties going to the smaller; escapes are the codes 2**w-1."""
    rng = np.random.default_rng(seed)
    exponent = (120 - rng.geometric(0.5, (3, 256)).clip(0, 1 << spread) + 1).astype(np.uint16)
    coding = choose(exponent, BF16)
    for g in range(3):
        offsets = int(coding.bases[g]) - exponent[g].astype(np.int64)
        costs = [_cost(offsets, w) for w in range(9)]
        assert int(coding.widths[g]) == costs.index(min(costs))
        top = (1 << int(coding.widths[g])) - 1
        assert (coding.codes[g][coding.escaped[g]] == top).all()
        assert (coding.codes[g][~coding.escaped[g]] == offsets[~coding.escaped[g]]).all()


def test_a_group_of_one_exponent_takes_width_zero() -> None:
    """A group whose exponents are all equal takes width 0 and escapes nothing."""
    coding = choose(np.full((1, 256), 7, dtype=np.uint16), FP16)
    assert coding.widths.tolist() == [0] and not coding.escaped.any() and coding.bases.tolist() == [7]
