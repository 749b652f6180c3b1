"""torpor.statemachine.log.segments: the active file and its rotated segments, as the writer names them and readers list them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import torpor.statemachine.log.segments as segments_module
from torpor.statemachine.log.segments import rotated, segment_path, segments


def test_a_rotated_segment_is_named_by_its_first_seq_and_listed_oldest_first(tmp_path: Path) -> None:
    """segment_path names NAME.<first seq> (12 digits); rotated lists those oldest first, ignoring other NAME.* files."""
    path = tmp_path / "e.jsonl"
    assert segment_path(path, 7) == tmp_path / "e.jsonl.000000000007"
    for first in (120, 7, 1_000_000_000_000):
        segment_path(path, first).write_bytes(b"")
    (tmp_path / "e.jsonl.lock").write_bytes(b"")
    (tmp_path / ".e.jsonl.next").write_bytes(b"")
    (tmp_path / "e.jsonl.\u0663").write_bytes(b"")  # a non-ASCII digit is no sequence number
    assert [first for first, _ in rotated(path)] == [7, 120, 1_000_000_000_000]
    assert segments(path) == [p for _, p in rotated(path)]
    path.write_bytes(b"")
    assert segments(path)[-1] == path


def test_segments_never_comes_back_empty_while_a_rotation_renames_the_active_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rotation renaming the active file while segments() looks still leaves it a file (no 'no event log')."""
    path = tmp_path / "e.jsonl"
    path.write_bytes(b"")
    real = segments_module.rotated

    def rename_after_the_glob(active: str | os.PathLike[str]) -> list[tuple[int, Path]]:
        found = real(active)  # the glob saw no segment yet ...
        if path.exists():
            os.replace(path, path.with_name(f"{path.name}.{1:012d}"))  # ... then the writer renamed the active file
        return found

    monkeypatch.setattr(segments_module, "rotated", rename_after_the_glob)
    assert segments(path) != []
