"""The sleep/wake cycle's part that checks every wake: seal the backed-up pieces at sleep, compare at wake (issue 53).

:class:`WakeChecks` works on a tag's record: ``record.sums`` maps each backed-up piece's device
address to its chunks' sums (:mod:`torpor.allocator.squeeze.wakecheck`). A release seals each
batch of pieces after the batch's copy finished and before its unmap (:meth:`WakeChecks.seal`);
a restore, once its copies finished, computes the sums again over the restored pieces and
compares (:meth:`WakeChecks.check`): the first chunk that differs raises
:class:`~torpor.errors.WakeCheckFailed`, which the restore turns into its rollback. A piece
with no sums (sealed by no release: a kept range, a backup adopted from the keeper) is not
checked. Off (``TORPOR_CHECK_WAKES=0``, or no summer for the driver): nothing is sealed or checked.
The checker's own failure (a kernel that cannot run, say) is logged and leaves the pieces unchecked:
only bytes that differ fail a wake.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from torpor.allocator.sleepwake.plan import Piece
from torpor.allocator.squeeze.wakecheck import Region, Summer, Sums, checks_on, compare, summer_for
from torpor.errors import WakeCheckFailed

logger = logging.getLogger("torpor.allocator")


class WakeChecks:
    """Seals and checks the pieces of backed-up tags; ``summer`` None (off) does neither."""

    def __init__(self, driver: Any, *, enabled: bool | None = None) -> None:
        on = checks_on() if enabled is None else enabled
        self.summer: Summer | None = summer_for(driver) if on else None

    def seal(self, sums: dict[int, Sums], pieces: Sequence[Piece], at: int = 0, hi: int = 1 << 64) -> int:
        """Record the sums of ``pieces[at:]`` (sorted by start) that start below ``hi`` and are not sealed yet (their
        bytes copied and still mapped); the index of the first piece left. A release walks its batches with it."""
        end = at
        while end < len(pieces) and pieces[end].start < hi:
            end += 1
        if self.summer is not None:
            fresh = [p for p in pieces[at:end] if p.start not in sums]
            self.seal_regions(sums, [(p.start, p.size, p.device) for p in fresh])
        return end

    def check(self, tag: str, sums: dict[int, Sums], pieces: Sequence[Piece]) -> int:
        """Compare the restored pieces with their sums; the bytes checked, or WakeCheckFailed at the first difference."""
        return self.check_regions(tag, sums, [(p.start, p.size, p.device) for p in pieces])

    def seal_regions(self, sums: dict[int, Sums], spans: Iterable[tuple[int, int, int]]) -> None:
        """Record the sums of each (address, bytes, device) under its address (the bytes still mapped; for a backup made
        outside the cycle too, torpor.tms's shadows)."""
        if self.summer is None:
            return
        regions = [Region(*span) for span in spans]
        if not regions:
            return
        try:
            found = self.summer.sums(regions)
        except Exception:  # the checker's own failure: these regions go unchecked, the sleep goes on
            logger.warning("sealing %d piece(s) failed: their next wake is not checked", len(regions), exc_info=True)
            return
        for region, sums_of in zip(regions, found, strict=True):
            sums[region.address] = sums_of

    def check_regions(self, tag: str, sums: dict[int, Sums], spans: Iterable[tuple[int, int, int]]) -> int:
        """Compare each restored (address, bytes, device) that has sums; the bytes checked, or WakeCheckFailed."""
        if self.summer is None:
            return 0
        todo = [Region(*span) for span in spans if span[0] in sums]
        if not todo:
            return 0
        try:
            found = self.summer.sums(todo)
        except Exception:  # the checker's own failure is not the bytes': this wake goes unchecked
            logger.warning("checking the wake of %r failed: its bytes are not checked", tag, exc_info=True)
            return 0
        differ = compare(todo, [sums[r.address] for r in todo], found)
        if differ:
            first = differ[0]
            logger.error("wake of %r: %d chunk(s) differ from the sleep's checksums", tag, len(differ))
            raise WakeCheckFailed(
                tag,
                address=first.address,
                nbytes=first.nbytes,
                piece=first.region.address,
                chunk=first.chunk,
                recorded=first.recorded,
                found=first.found,
                count=len(differ),
            )
        return sum(r.nbytes for r in todo)


__all__ = ["WakeChecks"]
