"""What a keep source names: ranges of a tag to keep across a discard (:mod:`torpor.allocator.kept_ranges.keeping`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class KeptRange:
    """One range a discard must not lose: what it is (for messages), its device address and size."""

    name: str
    address: int
    nbytes: int


@runtime_checkable
class KeepSource(Protocol):
    """Names the ranges of a tag to keep across a discard (asked at each discard: tensors move and go)."""

    def ranges(self) -> Sequence[KeptRange]:
        """The ranges to keep now; those outside the tag's allocations are not discarded and are skipped."""
        ...

    def fresh(self, inside: Callable[[int, int], bool]) -> None:
        """After a restore without a backup, once the kept ranges are back; ``inside(address, nbytes)``: in the tag."""
        ...
