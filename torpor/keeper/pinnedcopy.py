"""Copying a kept backup into a model's tensors at host-link speed: regions pinned in pieces on several threads.

Pinning (``cudaHostRegister``) a kept region costs more than copying it: one
thread pins the keeper's shared memory at about 7 GB/s (the 14.4 GB of an
8B-shaped model took 2.1 s on the H200), while the copy runs at the link's
55 GB/s. Most of a pin's cost is faulting the pages into this process's page
tables (the keeper's shared memory is 4 KiB pages here: shmem gets no
transparent huge pages unless ``shmem_enabled`` allows them), and the
driver's registration takes them one call at a time. So :class:`PinnedPieces`
cuts the regions into pieces of :data:`PIECE_BYTES`; on up to ``threads``
threads, in address order, each piece is faulted in first (``populate``:
``MADV_POPULATE_WRITE``, in parallel; torch's pinned host allocator
pre-faults on threads before it registers for the same reason) and then
pinned; :func:`copy_into` enqueues the copies in host-address order, each
waiting only for the pieces under it: the first pieces are copied while the
later ones are pinned. A piece whose pin failed is copied from as pageable
memory (slower, the same bytes). Mechanism only: the pin and unpin calls are
the caller's (:func:`torpor.keeper.adoption.adopt` passes CUDA's).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from torpor.errors import BadArgument

if TYPE_CHECKING:
    import torch

__all__ = ["PIECE_BYTES", "PinnedPieces", "copy_into"]

logger = logging.getLogger("torpor.keeper")

#: The pinning unit: small enough that the first copies start early, large enough that the calls are few.
PIECE_BYTES = 256 * 1024 * 1024


class Segments(Protocol):
    """What :func:`copy_into` reads of a backup: each tensor's (host address, bytes, offset in the tensor)."""

    def segments(self, name: str) -> Iterable[tuple[int, int, int]]: ...


class PinnedPieces:
    """``regions`` (address, bytes) pinned piece by piece by a pool of threads; :meth:`pinned` waits for a range.

    ``pin(address, nbytes)`` returns whether it pinned (it may raise: a failed
    pin); ``unpin(address, nbytes)`` undoes one; ``populate(address, nbytes)``,
    if given, faults a piece in on the same thread just before its pin. :meth:`release` unpins what
    was pinned; the caller makes sure no copy still reads the memory first.
    """

    def __init__(
        self,
        regions: Iterable[tuple[int, int]],
        pin: Callable[[int, int], bool],
        unpin: Callable[[int, int], object],
        *,
        threads: int,
        piece_bytes: int = PIECE_BYTES,
        populate: Callable[[int, int], object] | None = None,
    ) -> None:
        if piece_bytes <= 0 or threads <= 0:
            msg = f"piece_bytes={piece_bytes} and threads={threads} must be positive"
            raise BadArgument(msg)
        self._pin, self._unpin, self._populate = pin, unpin, populate
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torpor-adopt-pin")
        self._pieces: list[tuple[int, int, Future[bool]]] = []
        for address, nbytes in sorted(regions):
            for offset in range(0, nbytes, piece_bytes):
                n = min(piece_bytes, nbytes - offset)
                self._pieces.append((address + offset, n, self._pool.submit(self._try_pin, address + offset, n)))
        self._starts = [start for start, _, _ in self._pieces]

    def _try_pin(self, address: int, nbytes: int) -> bool:
        try:
            if self._populate is not None:
                self._populate(address, nbytes)  # advice: a piece not faulted in here is faulted in by the pin
            return bool(self._pin(address, nbytes))
        except Exception:
            logger.exception("pinning %d kept bytes at %#x failed; they are copied as pageable memory", nbytes, address)
            return False

    @property
    def pieces(self) -> int:
        return len(self._pieces)

    def pinned(self, host: int, nbytes: int) -> bool:
        """Block until the pins of the pieces under ``[host, host + nbytes)`` are done; whether each one pinned."""
        i = bisect.bisect_right(self._starts, host) - 1
        if i < 0:
            return False
        ok, covered = True, host
        while i < len(self._pieces) and self._pieces[i][0] < host + nbytes:
            start, n, done = self._pieces[i]
            if start > covered:  # a gap between pieces: not in any region
                return False
            if start + n > host:
                ok = done.result() and ok
                covered = start + n
            i += 1
        return ok and covered >= host + nbytes

    def release(self) -> None:
        """Wait for the pins still running, then unpin every pinned piece (on the pool's threads)."""
        unpins = [self._pool.submit(self._unpin, s, n) for s, n, done in self._pieces if done.result()]
        for unpin in unpins:
            try:
                unpin.result()
            except Exception:
                logger.exception("unpinning a kept piece failed")
        self._pool.shutdown()


def copy_into(backup: Segments, tensors: Iterable[tuple[str, torch.Tensor]], pieces: PinnedPieces | None = None) -> int:
    """Copy each named tensor's bytes from ``backup``, in host-address order; the bytes copied.

    Each tensor's segments must cover it exactly (every byte once, no more):
    otherwise a ``ValueError`` names the tensor before any copy is made.

    With ``pieces``, a copy from pinned pieces is enqueued without waiting for
    it (the caller synchronizes); any other copy completes before the next.
    """
    import ctypes

    import torch

    copies = []
    for name, t in tensors:
        flat = t.detach().view(-1).view(torch.uint8)
        parts = list(backup.segments(name))
        covered = sorted((at, n) for _, n, at in parts)
        ends = [at + n for at, n in covered]
        starts = [at for at, _ in covered]
        if sum(n for _, n in covered) != flat.numel() or starts != [0, *ends[:-1]]:
            msg = (
                f"tensor {name!r}: the backup covers {sum(n for _, n in covered)} of its {flat.numel()} bytes "
                "(its segments must cover it exactly, in order, once); nothing was copied"
            )
            raise BadArgument(msg)
        copies += [(host, n, at, flat) for host, n, at in parts]
    copies.sort(key=lambda c: c[0])
    total = 0
    for host, n, at, flat in copies:
        pinned = pieces is not None and pieces.pinned(host, n)
        src = torch.frombuffer((ctypes.c_char * n).from_address(host), dtype=torch.uint8)
        flat[at : at + n].copy_(src, non_blocking=pinned)
        total += n
    return total
