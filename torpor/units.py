"""Byte units, one home: ``KiB``, ``MiB``, ``GiB`` and a byte count as torpor prints it (:func:`byte_size`)."""

from __future__ import annotations

__all__ = ["GiB", "KiB", "MiB", "byte_size"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def byte_size(nbytes: float) -> str:
    """A byte count as the keeper's messages and ``torpor keeper status`` print it: ``8.00 MiB``, ``512 B``."""
    value = float(nbytes)
    for unit in _UNITS[:-1]:
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} {_UNITS[-1]}"
