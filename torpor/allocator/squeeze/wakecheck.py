"""Every wake checked (issue 53): the sum64 of each chunk of a backed-up piece, taken at sleep, compared at wake.

A sleep seals each piece it backed up while the piece is still mapped (right after the piece's copy
to host memory finished, before its unmap): per chunk of :data:`CHECK_CHUNK` bytes, the sum64 of
:mod:`.sum64` over the device bytes. A wake computes the same sums over the restored bytes once its
copies finished and compares: the first chunk that differs is :class:`~torpor.errors.WakeCheckFailed`
(tag, chunk, address range, both sums), and the wake is rolled back. Backed-up bytes only: the blocks
torch held free are not copied, so they are not checked either.

Who computes the sums is a :class:`Summer`, chosen by the driver (:func:`summer_for`):

* :class:`ReadingSummer` reads the bytes through the driver and runs the numpy reference: the
  simulated device, whose memory is host memory;
* :class:`CudaSummer` runs the Triton kernels of :mod:`.gpucodec` on the GPU over the pieces in
  place (a CUDA Array Interface view of each piece; nothing is copied to the host but the sums).

Where neither can run (CUDA without Triton), :func:`summer_for` gives None and the wakes are not
checked; the allocator logs that once and its transfers say so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from torpor.allocator.squeeze.sum64 import sum64
from torpor.errors import BadArgument
from torpor.switches import env_switch
from torpor.units import MiB

logger = logging.getLogger("torpor.allocator")

#: Bytes per checked chunk: small enough to name where damage is, large enough to cost nothing per chunk.
CHECK_CHUNK = 1 * MiB
#: The switch that turns the checks off (``0``); on when unset.
CHECK_ENV = "TORPOR_CHECK_WAKES"


def checks_on() -> bool:
    """Whether wakes are checked: unless ``TORPOR_CHECK_WAKES=0``; a typo is refused (BadSetting)."""
    return env_switch(CHECK_ENV)


class Region(NamedTuple):
    """Device bytes to check: ``nbytes`` at ``address`` on ``device``."""

    address: int
    nbytes: int
    device: int


class Mismatch(NamedTuple):
    """A chunk whose sums differ: region ``region``, chunk ``chunk`` of it, the sum at sleep and the one found."""

    region: Region
    chunk: int
    recorded: int
    found: int

    @property
    def address(self) -> int:
        """The chunk's first device address."""
        return self.region.address + self.chunk * CHECK_CHUNK

    @property
    def nbytes(self) -> int:
        """The chunk's length (the last chunk of a region may be short)."""
        return min(CHECK_CHUNK, self.region.nbytes - self.chunk * CHECK_CHUNK)


Sums = tuple[int, ...]
"""One region's sums, chunk by chunk (each an unsigned 64-bit value)."""


class Summer(Protocol):
    """Computes the per-chunk sums of device regions."""

    def sums(self, regions: Sequence[Region]) -> list[Sums]:
        """Each region's sums, in order."""
        ...


class ReadingSummer:
    """Sums over bytes read through the driver, by the numpy reference (the simulated device)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def sums(self, regions: Sequence[Region]) -> list[Sums]:
        """Each region's sums, reading its bytes through ``driver.read``."""
        out: list[Sums] = []
        for region in regions:
            data = np.frombuffer(self.driver.read(region.address, region.nbytes), dtype=np.uint8)
            out.append(tuple(sum64(data[k : k + CHECK_CHUNK], start=k) for k in range(0, region.nbytes, CHECK_CHUNK)))
        return out


class _DeviceBytes:
    """Raw device bytes as an object torch can view without a copy (the CUDA Array Interface, version 3)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,  # the caller waited for the copies: nothing to synchronize with
        }


class CudaSummer:
    """Sums on the GPU by :func:`~.gpucodec.sum64_gpu`, over each region in place; one host round trip per call.

    The kernels run on a stream of the summer's own per device, so they wait for no work the
    engine queued on its streams (the caller waited for the copies of the bytes it sums).
    """

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def sums(self, regions: Sequence[Region]) -> list[Sums]:
        """Each region's sums, computed on the summer's stream of the region's device."""
        import torch

        from torpor.allocator.squeeze.gpucodec import sum64_gpu

        parts = []
        for region in regions:
            with torch.cuda.device(region.device):
                stream = self._streams.get(region.device)
                if stream is None:
                    stream = self._streams[region.device] = torch.cuda.Stream(region.device)  # type: ignore[no-untyped-call]
                with torch.cuda.stream(stream):
                    view = torch.as_tensor(_DeviceBytes(region.address, region.nbytes), device=f"cuda:{region.device}")
                    parts.append(sum64_gpu(view, CHECK_CHUNK))
        mask = (1 << 64) - 1  # every kernel is queued: the first read waits for them all, once
        return [tuple(int(v) & mask for v in part.tolist()) for part in parts]


def summer_for(driver: Any) -> Summer | None:
    """The summer for ``driver``: the GPU's kernels for CUDA (None without Triton), else the reference."""
    if not driver.is_cuda:
        return ReadingSummer(driver)
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        logger.warning("wakes are not checked: the GPU's checksum kernels need torch and triton, not installed here")
        return None
    return CudaSummer()


def compare(regions: Sequence[Region], recorded: Sequence[Sums], found: Sequence[Sums]) -> list[Mismatch]:
    """Every chunk whose sums differ, region by region (a region whose chunk count changed differs at its first)."""
    if not len(regions) == len(recorded) == len(found):
        msg = f"compare needs one recorded and one found per region: {len(regions)}, {len(recorded)}, {len(found)}"
        raise BadArgument(msg)
    out: list[Mismatch] = []
    for region, before, after in zip(regions, recorded, found, strict=True):
        if len(before) != len(after):
            out.append(Mismatch(region, 0, before[0] if before else 0, after[0] if after else 0))
            continue
        out += [Mismatch(region, k, b, a) for k, (b, a) in enumerate(zip(before, after, strict=True)) if b != a]
    return out


__all__ = [
    "CHECK_CHUNK",
    "CHECK_ENV",
    "CudaSummer",
    "Mismatch",
    "ReadingSummer",
    "Region",
    "Summer",
    "Sums",
    "checks_on",
    "compare",
    "summer_for",
]
