"""Tests for the package as a whole: layering, exports, and no runtime asserts."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torpor

ROOT = Path(__file__).resolve().parent.parent


def test_statemachine_imports_no_torch_or_cuda() -> None:
    """Importing torpor.statemachine (and torpor.testing) loads neither torch nor cuda."""
    code = (
        "import sys, torpor.statemachine, torpor.testing; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cuda')]; "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_assert_statements_in_torpor() -> None:
    """torpor/ has no assert statements (they vanish under python -O)."""
    found = []
    for path in (ROOT / "torpor").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assert):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_public_names_exported() -> None:
    """The names the docs use are importable from torpor."""
    for name in ("SleepController", "State", "replay", "TorporError", "InvalidTransition", "PoolBusy", "EventLog"):
        assert hasattr(torpor, name), name
    assert set(torpor.__all__) <= set(dir(torpor))


def test_every_error_derives_from_torpor_error() -> None:
    """Every exception class in torpor.errors derives from TorporError."""
    for name in dir(torpor.errors):
        obj = getattr(torpor.errors, name)
        if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == "torpor.errors":
            assert issubclass(obj, torpor.TorporError), name


def test_subpackage_names_load_on_first_use() -> None:
    """torpor.TaggedAllocator, torpor.attach and torpor.follow resolve to their subpackages' objects."""
    from torpor.allocator import TaggedAllocator
    from torpor.hooks import follow
    from torpor.telemetry import attach

    assert torpor.TaggedAllocator is TaggedAllocator
    assert torpor.attach is attach
    assert torpor.follow is follow
