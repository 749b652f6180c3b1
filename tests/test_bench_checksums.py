"""torpor.bench.checksums: the device checksums that decide whether a sleep and wake lost a byte."""

from __future__ import annotations

import pytest

from torpor.bench.checksums import module_checksums, tensor_checksum

torch = pytest.importorskip("torch")


def test_a_changed_word_changes_the_checksum() -> None:
    """One bf16 element changed by one ulp gives another checksum."""
    t = torch.randn(1000, dtype=torch.float32).to(torch.bfloat16)
    before = tensor_checksum(t)
    t.view(torch.int16)[123] += 1
    assert tensor_checksum(t) != before


def test_swapped_words_change_the_weighted_sum() -> None:
    """Two words swapped keep the plain sum and change the position-weighted one."""
    t = torch.arange(16, dtype=torch.int32)
    plain, weighted = tensor_checksum(t)
    t[[2, 9]] = t[[9, 2]]
    assert tensor_checksum(t)[0] == plain and tensor_checksum(t)[1] != weighted


def test_a_size_no_multiple_of_four_is_summed_by_bytes() -> None:
    """A 3-byte tensor is read byte by byte: its checksum is its bytes' sums."""
    t = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert tensor_checksum(t) == (6, 1 * 1 + 2 * 2 + 3 * 3)


def test_every_parameter_and_buffer_is_named() -> None:
    """module_checksums covers parameters and buffers (a BatchNorm's running stats too)."""
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    names = set(module_checksums(m))
    assert {"0.weight", "0.bias", "1.weight", "1.running_mean", "1.running_var"} <= names
