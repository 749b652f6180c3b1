"""configure_subprocess(): LD_PRELOAD composed as TMS composes it, restored after, unchanged while the library is not built."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torpor.tms import preload
from torpor.tms.preload import PRELOAD_NAME, configure_subprocess, prepended


def test_prepended_as_tms() -> None:
    """The library goes first, the old value after a colon; alone when there was none."""
    assert prepended("", "/x/lib.so") == "/x/lib.so"
    assert prepended("/other.so", "/x/lib.so") == "/x/lib.so:/other.so"


def test_the_library_name_says_torch_memory_saver() -> None:
    """Code that looks for 'torch_memory_saver' on LD_PRELOAD (TMS's own check) finds torpor's library."""
    assert "torch_memory_saver" in PRELOAD_NAME


@pytest.mark.parametrize("initial", [None, "/other/lib.so"])
def test_configure_subprocess_sets_and_restores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, initial: str | None
) -> None:
    """Inside the block LD_PRELOAD starts with torpor's library and keeps what was there; after it, as before."""
    lib = tmp_path / PRELOAD_NAME
    lib.write_bytes(b"")
    monkeypatch.setattr(preload, "preload_library", lambda: lib)
    if initial is None:
        monkeypatch.delenv("LD_PRELOAD", raising=False)
    else:
        monkeypatch.setenv("LD_PRELOAD", initial)
    with configure_subprocess():
        parts = os.environ["LD_PRELOAD"].split(":")
        assert parts[0] == str(lib)
        assert parts[1:] == ([] if initial is None else [initial])
    assert os.environ.get("LD_PRELOAD") == initial


def test_without_the_library_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no preload library built, the block leaves LD_PRELOAD as it was."""
    monkeypatch.setattr(preload, "preload_library", lambda: None)
    monkeypatch.setenv("LD_PRELOAD", "/keep.so")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == "/keep.so"
