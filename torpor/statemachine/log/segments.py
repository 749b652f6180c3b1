"""Which files make up an event log: the active file ``NAME`` and its rotated segments ``NAME.<first seq>``.

The writer (:class:`~torpor.statemachine.log.eventlog.EventLog`) rotates by
renaming the active file to :func:`segment_path` and starting a new one; every
reader (:class:`~torpor.statemachine.log.tail.Tail`, the endpoint's and the
vLLM routes' log sources) lists the files with :func:`rotated` and
:func:`segments`. The name is written and read here only.
"""

from __future__ import annotations

import os
from pathlib import Path


def segment_path(active: str | os.PathLike[str], first: int) -> Path:
    """Where the active file at ``active`` goes when it is rotated: ``NAME.<first seq>``, zero-padded to 12 digits."""
    active = Path(active)
    return active.with_name(f"{active.name}.{first:012d}")


def rotated(active: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The rotated segments ``NAME.<first seq>`` of the log at ``active``, oldest first, with their first seq."""
    active = Path(active)
    found: list[tuple[int, Path]] = []
    if active.parent.is_dir():
        for candidate in active.parent.glob(active.name + ".*"):
            suffix = candidate.name[len(active.name) + 1 :]
            if suffix.isascii() and suffix.isdigit():
                found.append((int(suffix), candidate))
    found.sort()
    return found


def segments(path: str | os.PathLike[str]) -> list[Path]:
    """The log's files in order: rotated segments (oldest first), then the active file.

    The active file is looked at first: a rotation renames it to a segment
    before the next one takes its name, so a log either has its active file at
    that look or the segment in the listing made after it (the other order read
    an empty log in the middle of a rotation).
    """
    active = Path(path)
    present = active.exists()
    files = [p for _, p in rotated(path)]
    if present:  # may be renamed meanwhile: readers treat a vanished active file as mid-rotation
        files.append(active)
    return files
