"""Bit-plane packing (numpy reference): per block of 32 values, one little-endian 32-bit word per bit.

Word ``b`` of a lane block holds bit ``b`` of each of its 32 values, value ``i`` at bit ``i``.
A GPU builds such a word with one reduction over 32 lanes and reads a value's bit back with a
shift, whatever the width, which is why the format packs codes this way and not end to end.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from torpor.allocator.squeeze.layout import GROUP, LANES

BLOCKS = GROUP // LANES


def _mask(widths: npt.NDArray[np.uint8], planes: int) -> npt.NDArray[np.bool_]:
    """Which planes of each (group, lane block) are stored: those below the group's width."""
    keep = np.arange(planes)[None, None, :] < widths.astype(np.int64)[:, None, None]
    return np.broadcast_to(keep, (widths.size, BLOCKS, planes))


def pack(codes: npt.NDArray[np.uint16], widths: npt.NDArray[np.uint8], planes: int) -> npt.NDArray[np.uint8]:
    """The bit-planes of ``codes`` (groups x 256) below each group's width, in (group, block, plane) order, as bytes."""
    blocks = codes.reshape(-1, BLOCKS, LANES)
    stack = np.empty((blocks.shape[0], BLOCKS, planes, 4), dtype=np.uint8)
    for b in range(planes):
        stack[:, :, b, :] = np.packbits(((blocks >> b) & 1).astype(np.uint8), axis=-1, bitorder="little")
    return stack[_mask(widths, planes)].reshape(-1)


def unpack(data: npt.NDArray[np.uint8], widths: npt.NDArray[np.uint8], planes: int) -> npt.NDArray[np.uint16]:
    """The codes (groups x 256) whose bit-planes :func:`pack` wrote (``data`` holds exactly those bytes)."""
    stack = np.zeros((widths.size, BLOCKS, planes, 4), dtype=np.uint8)
    stack[_mask(widths, planes)] = data.reshape(-1, 4)
    bits = np.unpackbits(stack, axis=-1, bitorder="little").astype(np.uint16)
    codes = np.zeros((widths.size, BLOCKS, LANES), dtype=np.uint16)
    for b in range(planes):
        codes |= bits[:, :, b, :] << np.uint16(b)
    return codes.reshape(-1, GROUP)


def words(groups: int, widths: npt.NDArray[np.uint8]) -> int:
    """How many 32-bit words the code planes of ``groups`` groups of ``widths`` take."""
    return BLOCKS * int(widths[:groups].astype(np.int64).sum())


__all__ = ["BLOCKS", "pack", "unpack", "words"]
