"""docs/vllm.md's list of calls vLLM makes on its allocator instance matches the installed vLLM's source, and the facade answers each."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from torpor.hooks.vllm.facade import TorporMemAllocator  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm.md"
#: vLLM's own allocator classes: their calls on themselves are not calls on the instance vLLM hands out.
SKIP = {"vllm/device_allocator/cumem.py", "vllm/device_allocator/xpumem.py"}


def _is_instance_expr(node: ast.AST) -> bool:
    """``get_mem_allocator_instance()``, ``CuMemAllocator.get_instance()``, ``CuMemAllocator.instance``, or a cast of one."""
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id == "get_mem_allocator_instance":
            return True
        if isinstance(func, ast.Attribute) and func.attr == "get_mem_allocator_instance":
            return True
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "get_instance"
            and isinstance(func.value, ast.Name)
            and func.value.id == "CuMemAllocator"
        ):
            return True
        if isinstance(func, ast.Name) and func.id == "cast" and len(node.args) == 2:
            return _is_instance_expr(node.args[1])
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "instance"
        and isinstance(node.value, ast.Name)
        and node.value.id == "CuMemAllocator"
    )


def _scopes(tree: ast.Module) -> Iterator[ast.AST]:
    yield tree
    yield from (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


def vllm_allocator_calls(root: Path) -> set[tuple[str, str]]:
    """``(attribute, file)`` for every attribute vLLM reads on the allocator instance, found in its source."""
    found: set[tuple[str, str]] = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel in SKIP:
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        if "get_mem_allocator_instance" not in source and "CuMemAllocator" not in source:
            continue
        tree = ast.parse(source)
        for scope in _scopes(tree):
            names: set[str] = set()
            if not isinstance(scope, ast.Module):  # a name bound to the instance, inside one function
                for node in ast.walk(scope):
                    if isinstance(node, ast.Assign) and _is_instance_expr(node.value):
                        names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            for node in ast.walk(scope):
                if not isinstance(node, ast.Attribute):
                    continue
                value = node.value
                if _is_instance_expr(value) or (isinstance(value, ast.Name) and value.id in names):
                    found.add((node.attr, rel))
    return found


@functools.cache
def installed_calls() -> frozenset[tuple[str, str]]:
    """The scan of the installed vllm, once per test session."""
    return frozenset(vllm_allocator_calls(Path(vllm.__file__).parent))


def documented_calls() -> set[tuple[str, str]]:
    """The rows of the table between the ``vllm-calls`` markers in docs/vllm.md."""
    text = DOC.read_text(encoding="utf-8")
    block = text.split("<!-- vllm-calls:start -->", 1)[1].split("<!-- vllm-calls:end -->", 1)[0]
    rows = set()
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(\w+)\(?\)?`", cells[0]) if cells and cells[0] else None
        if match:
            for file in re.findall(r"`(vllm/[\w/]+\.py)`", cells[1]):
                rows.add((match.group(1), file))
    return rows


def test_documented_call_list_matches_installed_vllm() -> None:
    """Every call vLLM 0.33 makes on the allocator instance is in docs/vllm.md, and nothing else is."""
    found = set(installed_calls())
    assert found, "the scan found no calls at all: the scanner is broken"
    assert documented_calls() == found


def test_facade_answers_every_call() -> None:
    """torpor's facade has a callable for every attribute vLLM reads on the allocator instance."""
    for attr, where in sorted(installed_calls()):
        assert callable(getattr(TorporMemAllocator, attr, None)), f"{attr} (called in {where})"


def test_scanner_sees_all_three_shapes(tmp_path: Path) -> None:
    """The scan finds chained calls, names bound in a function, casts and CuMemAllocator.instance; not other names."""
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "def f():\n"
        "    get_mem_allocator_instance().alpha()\n"
        "    allocator = cast('CuMemAllocator', get_mem_allocator_instance())\n"
        "    allocator.beta()\n"
        "    CuMemAllocator.instance.gamma()\n"
        "def g(allocator):\n"
        "    allocator.delta()\n"
    )
    assert vllm_allocator_calls(pkg) == {("alpha", "vllm/a.py"), ("beta", "vllm/a.py"), ("gamma", "vllm/a.py")}
