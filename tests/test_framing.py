"""Tests for torpor.statemachine.log.framing: a log file's bytes framed into lines a window at a time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torpor.errors import LogCorrupted
from torpor.statemachine.log import framing


def test_lines_come_in_windows_and_the_torn_end_is_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lines spanning many windows all come out once, in order; the bytes after the last newline are counted."""
    monkeypatch.setattr(framing, "CHUNK", 64)
    path = tmp_path / "e.jsonl"
    lines = [f"line {i:04d} ".encode() * (i % 5 + 1) for i in range(200)]
    path.write_bytes(b"\n".join(lines) + b"\ntorn")
    torn = [0]
    batches = list(framing.batches(path, 100, torn))
    assert len(batches) > 50
    assert [line for batch in batches for line in batch] == lines
    assert torn == [4]


def test_a_line_over_the_limit_raises_after_the_lines_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A line with no newline within max_line + 1 bytes is LogCorrupted at its line number, after the whole lines before it."""
    monkeypatch.setattr(framing, "CHUNK", 64)  # windows of max_line + 1 bytes (a longer line inside one is the codec's)
    path = tmp_path / "e.jsonl"
    path.write_bytes(b"a\nb\n" + b"x" * 5000 + b"\nc\n")
    got: list[bytes] = []
    with pytest.raises(LogCorrupted, match="longer than the 4096-byte limit") as caught:
        for batch in framing.batches(path, 4096, [0]):
            got += batch
    assert got == [b"a", b"b"]
    assert caught.value.line == 3


def test_only_regular_files_are_opened(tmp_path: Path) -> None:
    """A FIFO (opened without blocking), a directory and /dev/null are refused, naming what they are."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, what in ((fifo, "a FIFO"), (tmp_path, "a directory"), (Path("/dev/null"), "a character device")):
        with pytest.raises(LogCorrupted, match=f"not a regular file \\({what}\\)"):
            framing.open_regular(path)
    regular = tmp_path / "e.jsonl"
    regular.write_bytes(b"")
    os.close(framing.open_regular(regular))
