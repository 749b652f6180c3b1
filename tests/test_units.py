"""Tests of torpor.units: the byte units and the one byte-size formatter."""

from __future__ import annotations

import pytest

from torpor.units import GiB, KiB, MiB, byte_size


def test_the_units_are_binary() -> None:
    """KiB, MiB and GiB are 2**10, 2**20 and 2**30 bytes."""
    assert (KiB, MiB, GiB) == (1024, 1024 * 1024, 1024 * 1024 * 1024)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (912 << 20, "912.00 MiB"),
        (3 << 30, "3.00 GiB"),
        (5 << 50, "5.00 PiB"),
    ],
)
def test_byte_counts_print_in_binary_units(nbytes: int, text: str) -> None:
    """Byte counts print in binary units with two decimals (whole bytes below 1 KiB), up to PiB."""
    assert byte_size(nbytes) == text
