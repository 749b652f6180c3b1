#!/usr/bin/env python3
"""torpor's layer table, the import analysis under it, and docs/architecture.md's generated parts.

The flow has one direction: command -> guard -> plan -> allocator -> events -> projections.
This module holds the one layer table (:data:`LAYERS`) and the parts of the layered packages
(:data:`SUBPACKAGES`), reads every module under ``torpor/`` by its source (``ast``), never by
importing it, and renders docs/architecture.md's layer table and module map from them.
``python scripts/architecture.py`` rewrites those two parts of the doc; ``--check`` only says
whether they are current (exit 1 when stale). tests/test_architecture.py checks the imports
against the table and that the doc is current.

An import ``from a.b import c`` where ``a.b.c`` is a module counts as importing ``a.b.c``. For the
layers, importing ``a.b.c`` is not counted as importing the packages ``a`` and ``a.b`` (the same rule
import-linter uses), so a package's ``__init__`` is a facade placed in its own layer.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


PACKAGE = ROOT / "torpor"


DOC = ROOT / "docs" / "architecture.md"


#: The layers, lowest first. A module imports only from its own layer or a lower one.
#: Each entry is a module name or a package prefix ending in ``.*`` (the package and all
#: below it); the most specific entry wins.
LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "core",
        "the machine's vocabulary (events, states, tag policy, the memory protocol), the "
        "projection as a fold, every error class: no I/O, no threads, no torch",
        (
            "torpor._version",
            "torpor.errors.*",
            "torpor.units",
            "torpor.extras",
            "torpor.switches",
            "torpor.statemachine.core.*",
            "torpor.statemachine.projection.*",
        ),
    ),
    (
        "log",
        "the event store: payload checks, the line codec, the files on disk, the writer, the one "
        "tailer every reader uses, and the subscriber fan-out",
        ("torpor.statemachine.log.*",),
    ),
    (
        "controller",
        "the guard and the plan: commands checked against the projection, memory calls, "
        "events appended, rollback, TP groups",
        ("torpor.statemachine", "torpor.statemachine.machine.*"),
    ),
    (
        "mechanism and subscribers",
        "the allocator (mechanism, no policy), telemetry and the hooks/integrations "
        "(subscribers, torch_memory_saver's API among them), the capture vocabulary the allocator and "
        "the hooks share, the read model over several ranks' logs, the HTTP client and the test helpers",
        (
            "torpor.allocator.*",
            "torpor.graphcapture",
            "torpor.readmodel.*",
            "torpor.torchgroup",
            "torpor.telemetry.*",
            "torpor.hooks.*",
            "torpor.tms.*",
            "torpor.keeper.*",
            "torpor.client",
            "torpor.testing",
            "torpor.testrig",
        ),
    ),
    (
        "entry points",
        "the package facade, the CLI and its commands, the demo and the benchmark harness",
        (
            "torpor",
            "torpor.__main__",
            "torpor.cli",
            "torpor.commands.*",
            "torpor.demo.*",
            "torpor.bench.*",
            "torpor.textout",
        ),
    ),
)


#: Inside a package, its parts (subpackages or modules), lowest first: a part imports only
#: from itself or a part before it; the package's own ``__init__`` is its facade, above all.
SUBPACKAGES: dict[str, tuple[str, ...]] = {
    "torpor.statemachine": ("core", "projection", "log", "machine"),
    "torpor.allocator": (
        "failures",
        "squeeze",
        "native",
        "host",
        "sleepwake",
        "kept_ranges",
        "torchside",
        "views",
        "routing",
        "rawpath",
        "tagged",
    ),
}


@dataclass(frozen=True)
class Import:
    """One import statement's target, where it is, and how it runs."""

    module: str  # the importing module
    target: str  # the imported module (or name's module)
    where: str  # file:line
    late: bool  # inside a function
    typing_only: bool  # under ``if TYPE_CHECKING:``


def _module_name(path: Path) -> str:
    """The dotted name of the module at ``path`` (a package by its ``__init__.py``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module under torpor/, by dotted name."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    """Whether an ``if`` test is ``TYPE_CHECKING`` (or ``typing.TYPE_CHECKING``)."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """The imports of one module, targets resolved to modules where they are modules."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    where_file = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    found: list[Import] = []

    def visit(node: ast.AST, late: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_late = late or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, late, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, late, typing_only)
                continue
            visit_stmt(child, child_late, typing_only)

    def add(target: str, node: ast.stmt | ast.expr, late: bool, typing_only: bool) -> None:
        found.append(Import(name, target, f"{where_file}:{node.lineno}", late, typing_only))

    def visit_stmt(node: ast.AST, late: bool, typing_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, late, typing_only)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                add(candidate if candidate in known else base, node, late, typing_only)
        else:
            dynamic = _dynamic_import(node)
            if dynamic is not None:
                add(dynamic, node, late, typing_only)
            visit(node, late, typing_only)

    visit(tree, False, False)
    return found


def _dynamic_import(node: ast.AST) -> str | None:
    """The module an ``importlib.import_module("...")`` or ``__import__("...")`` call loads (None: not one).

    A name that is not a string literal is not followed (``cli``'s command table, the
    package's lazy ``__getattr__``): those load modules that the table of names spells out.
    """
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )
    first = node.args[0]
    if named and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def layer_of(module: str) -> int:
    """The index in LAYERS of a torpor module (the most specific entry wins)."""
    best: tuple[int, int] | None = None  # (specificity, layer)
    for index, (_, _, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry.endswith(".*"):
                prefix = entry[:-2]
                if module == prefix or module.startswith(prefix + "."):
                    score = len(prefix)
                else:
                    continue
            elif module == entry:
                score = len(entry) + 1_000
            else:
                continue
            if best is None or score > best[0]:
                best = (score, index)
    if best is None:
        msg = f"{module} is in no layer of scripts/architecture.py's LAYERS: add it"
        raise LookupError(msg)
    return best[1]


def all_imports() -> list[Import]:
    """Every import of every torpor module."""
    known = modules()
    return [imp for name, path in known.items() for imp in imports(name, path, known)]


def is_torpor(target: str) -> bool:
    """Whether an import target is torpor or one of its modules."""
    return target == "torpor" or target.startswith("torpor.")


def render_table() -> str:
    """The layer table as markdown (docs/architecture.md holds it between markers)."""
    lines = ["| layer | what | modules |", "|---|---|---|"]
    known = modules()
    for index, (title, what, _) in enumerate(LAYERS):
        members = sorted(m for m in known if layer_of(m) == index)
        names = ", ".join(f"`{m}`" for m in members)
        lines.append(f"| {index} {title} | {what} | {names} |")
    return "\n".join(lines) + "\n"


BEGIN = "<!-- layers: generated by `python scripts/architecture.py`; do not edit by hand -->\n"


END = "<!-- /layers -->\n"


MAP_BEGIN = "<!-- module map: generated by `python scripts/architecture.py`; do not edit by hand -->\n"


MAP_END = "<!-- /module map -->\n"


def unit_of(module: str, known: dict[str, Path]) -> str:
    """The room a module belongs to in the module map: its package, or itself for a module directly under torpor/."""
    path = known.get(module)
    if path is None:
        return module
    if path.name == "__init__.py" or path.parent == PACKAGE:
        return module
    return module.rpartition(".")[0]


def render_module_map() -> str:
    """Each room (a package, or a top-level module) with its modules and the rooms it imports, lowest layer first."""
    known = modules()
    edges: dict[str, set[str]] = {}
    members: dict[str, list[str]] = {}
    for name in known:
        members.setdefault(unit_of(name, known), []).append(name.rpartition(".")[2] or name)
    for imp in all_imports():
        if not is_torpor(imp.target):
            continue
        src, dst = unit_of(imp.module, known), unit_of(imp.target, known)
        if src != dst:
            edges.setdefault(src, set()).add(dst)
    rooms = sorted(members, key=lambda u: (layer_of(u), u))
    lines = ["```"]
    for room in rooms:
        parts = sorted(m for m in members[room] if f"{room}" != m and not room.endswith("." + m) and m != room)
        inside = f" ({', '.join(parts)})" if parts else ""
        out = sorted(edges.get(room, ()), key=lambda u: (layer_of(u), u))
        lines.append(f"{room}{inside}")
        if out:
            lines.append("    -> " + ", ".join(out))
    lines.append("```")
    return "\n".join(lines) + "\n"


def _replace(text: str, begin: str, end: str, body: str) -> str:
    """``text`` with what lies between ``begin`` and ``end`` replaced by ``body``; ``LookupError`` without them."""
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        msg = f"docs/architecture.md has no {begin.strip()} ... {end.strip()} markers to write between"
        raise LookupError(msg)
    _, _, tail = rest.partition(end)
    return head + begin + body + end + tail


def rendered_doc(text: str) -> str:
    """``text`` with the layer table and the module map between their markers replaced by what the code gives."""
    return _replace(_replace(text, BEGIN, END, render_table()), MAP_BEGIN, MAP_END, render_module_map())


def main(argv: list[str] | None = None) -> int:
    """Rewrite docs/architecture.md's layer table and module map (``--check``: only say whether they are current)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when the doc is stale")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    try:
        rendered = rendered_doc(text)
    except LookupError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.check:
        if rendered != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python scripts/architecture.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(rendered)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
