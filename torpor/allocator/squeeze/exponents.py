"""Splitting 16-bit floats into fields and choosing each group's exponent code (numpy reference).

A value ``v`` is ``sign | exponent e | mantissa``; ``rest = sign << mantissa_bits | mantissa``.
Each group of 256 values takes ``base = max(e)`` and codes ``base - e`` in the width ``w`` that
costs least: ``256 * w`` bits of codes plus 8 bits for each value whose code does not fit
(``base - e >= 2**w - 1``, the escape), the smallest such ``w`` on a tie, at most 255 escapes.
Width 0 only where every exponent is ``base``. The GPU kernel makes the same choice, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from torpor.allocator.squeeze.layout import GROUP, Spec

#: A group may not escape more values than an escape count byte holds.
MAX_ESCAPES = 255
#: Bits an escaped value costs beyond its code (its exponent as a byte).
ESCAPE_BITS = 8


class Fields(NamedTuple):
    """A block of values split: the exponent field and the rest (sign above mantissa)."""

    exponent: npt.NDArray[np.uint16]
    rest: npt.NDArray[np.uint16]


class Coding(NamedTuple):
    """Each group's base and width, every value's code, and which values escaped."""

    bases: npt.NDArray[np.uint8]
    widths: npt.NDArray[np.uint8]
    codes: npt.NDArray[np.uint16]
    escaped: npt.NDArray[np.bool_]


def split(values: npt.NDArray[np.uint16], spec: Spec) -> Fields:
    """The exponent and rest fields of ``values`` (16-bit words) for ``spec``."""
    m = np.uint16(spec.mantissa_bits)
    exponent = (values >> m) & np.uint16((1 << spec.exponent_bits) - 1)
    rest = ((values >> np.uint16(15)) << m) | (values & np.uint16((1 << spec.mantissa_bits) - 1))
    return Fields(exponent, rest)


def join(fields: Fields, spec: Spec) -> npt.NDArray[np.uint16]:
    """The 16-bit words whose fields are ``fields`` (out-of-range bits are masked off, never raised)."""
    m = np.uint16(spec.mantissa_bits)
    sign = (fields.rest >> m) & np.uint16(1)
    exponent = fields.exponent & np.uint16((1 << spec.exponent_bits) - 1)
    words: npt.NDArray[np.uint16] = (
        (sign << np.uint16(15)) | (exponent << m) | (fields.rest & np.uint16((1 << spec.mantissa_bits) - 1))
    )
    return words


def choose(exponent: npt.NDArray[np.uint16], spec: Spec) -> Coding:
    """Each group's (rows of 256) base, width, codes and escapes, as the module's docstring says."""
    groups = exponent.shape[0]
    bases = exponent.max(axis=1) if groups else np.zeros(0, dtype=np.uint16)
    offsets = bases[:, None] - exponent
    best = np.where((offsets == 0).all(axis=1), 0, np.iinfo(np.int64).max)
    widths = np.zeros(groups, dtype=np.int64)
    for w in range(1, spec.exponent_bits + 1):
        escapes = (offsets >= (1 << w) - 1).sum(axis=1)
        cost = np.where(escapes <= MAX_ESCAPES, GROUP * w + ESCAPE_BITS * escapes, np.iinfo(np.int64).max)
        better = cost < best
        best = np.where(better, cost, best)
        widths = np.where(better, w, widths)
    top = ((np.uint16(1) << widths.astype(np.uint16)) - np.uint16(1))[:, None]
    escaped = (widths[:, None] > 0) & (offsets >= top)
    codes = np.where(escaped, top, offsets).astype(np.uint16)
    return Coding(bases.astype(np.uint8), widths.astype(np.uint8), codes, escaped)


__all__ = ["Coding", "Fields", "choose", "join", "split"]
