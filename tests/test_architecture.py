"""The import contract: the layer table, the direction between layers, no cycles, no hidden imports.

scripts/architecture.py holds the one layer table and reads every module under ``torpor/`` by its
source (``ast``), not by importing it; docs/architecture.md's layer table and module map are
generated from it (``python scripts/architecture.py``). This file checks the imports against the
table and that the doc is current.

For cycles, an import ``from a.b import c`` also counts the packages ``a`` and ``a.b``: Python runs
``a/__init__`` and ``a/b/__init__`` before ``a.b.c`` for an importer outside them, so a loop through
a package's ``__init__`` is a loop (:func:`import_graph`).
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from scripts.architecture import (
    BEGIN,
    DOC,
    END,
    LAYERS,
    MAP_BEGIN,
    MAP_END,
    PACKAGE,
    ROOT,
    SUBPACKAGES,
    Import,
    all_imports,
    imports,
    is_torpor,
    layer_of,
    modules,
    rendered_doc,
)
from torpor.statemachine import HostMemoryPolicy, Policy, SleepController
from torpor.testrig import fill, sim_rig

#: Function-level imports of torpor modules allowed, with the reason (module, imported) -> why.
#: Function-level imports of optional third-party packages (torch, cuda-bindings, ...) are allowed.
LATE_IMPORT_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("torpor.allocator.squeeze.wakecheck", "torpor.allocator.squeeze.gpucodec"): (
        "the GPU's checksum kernels (torch and triton at module level, optional third-party packages): the wake "
        "check loads them only on a CUDA driver, the first time it sums; the simulated device never needs them. "
        "No cycle: gpucodec imports the format's modules, never wakecheck."
    ),
    ("torpor.hooks.vllm.backend", "torpor.torchgroup"): (
        "torpor.torchgroup imports torch.distributed (an optional third-party package) at module "
        "level; the backend loads it only when vLLM hands it a torch process group. No cycle: "
        "torpor.torchgroup does not import the backend (test_no_import_cycles counts this edge)."
    ),
    ("torpor", "torpor.torchgroup"): (
        "the package hands the torch group adapter down to torpor.statemachine.machine.group (adapt_groups); "
        "torpor.torchgroup imports torch.distributed at module level, so it is loaded only when "
        "a controller is given a torch process group."
    ),
    ("torpor.hooks.vllm.facade", "torpor.allocator"): (
        "a worker's default memory: the allocator (and its native library) is loaded only when vLLM "
        "first asks the facade for memory, not when vLLM loads the plugin."
    ),
    ("torpor.hooks.vllm.activation", "torpor.hooks.vllm.keeperloader"): (
        "the keeper's load format imports the allocator (its native library) and the keeper; the plugin loads "
        "it only when $TORPOR_KEEPER_ENGINE asks for it. No cycle: the loader imports the keeper and its "
        "sibling modules, never activation, and the keeper imports nothing of torpor.hooks."
    ),
    ("torpor.hooks.vllm.activation", "torpor.telemetry.multiprocess"): (
        "the metrics directory for vLLM's workers (vLLM 0.33 names none with one API server): telemetry "
        "(prometheus_client) is optional, so activation loads it only when it makes or withdraws that "
        "directory, and a failure to load it leaves sleep and wake unaffected."
    ),
    ("torpor.hooks.vllm.wiring", "torpor.telemetry"): (
        "telemetry (prometheus_client) is loaded only when PROMETHEUS_MULTIPROC_DIR is set; it is a "
        "subscriber and optional."
    ),
}

#: Modules the allocator (mechanism) must never import: the controller, telemetry, hooks.
ALLOCATOR_FORBIDDEN = ("controller", "torpor.telemetry", "torpor.hooks")

#: Modules the core must never import (no torch, no threads, no I/O machinery).
CORE_FORBIDDEN = (
    "torch",
    "threading",
    "multiprocessing",
    "concurrent",
    "subprocess",
    "socket",
    "selectors",
    "asyncio",
    "http",
    "urllib",
    "signal",
    "fcntl",
    "mmap",
)


def _in(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


def layer_violations() -> list[str]:
    """Imports of a higher layer, as 'file:line module (layer) imports target (layer)'."""
    out = []
    for imp in all_imports():
        if not is_torpor(imp.target):
            continue
        mine, theirs = layer_of(imp.module), layer_of(imp.target)
        if theirs > mine:
            out.append(f"{imp.where}: {imp.module} ({LAYERS[mine][0]}) imports {imp.target} ({LAYERS[theirs][0]})")
    return out


def _part(module: str, package: str) -> str | None:
    """The part of ``package`` that ``module`` is in (None: outside it, or the package's facade)."""
    if not module.startswith(package + "."):
        return None
    return module[len(package) + 1 :].split(".", maxsplit=1)[0]


def subpackage_violations() -> list[str]:
    """Imports from a later part of the same package (SUBPACKAGES), as 'file:line module imports target'."""
    out = []
    for imp in all_imports():
        for package, parts in SUBPACKAGES.items():
            mine, theirs = _part(imp.module, package), _part(imp.target, package)
            if imp.target == package and mine is not None:  # a part importing its package's facade
                out.append(f"{imp.where}: {imp.module} ({mine}) imports the facade {package}")
            if mine is None or theirs is None:
                continue
            if mine not in parts or theirs not in parts:
                out.append(f"{imp.where}: {imp.module} or {imp.target} is in no part of SUBPACKAGES[{package!r}]")
            elif parts.index(theirs) > parts.index(mine):
                out.append(f"{imp.where}: {imp.module} ({mine}) imports {imp.target} ({theirs})")
    return list(dict.fromkeys(out))


def late_imports() -> list[str]:
    """Function-level imports of torpor modules not listed in LATE_IMPORT_EXCEPTIONS."""
    found = [
        f"{imp.where}: {imp.module} imports {imp.target} inside a function"
        for imp in all_imports()
        if imp.late and not imp.typing_only and is_torpor(imp.target) and imp.target != imp.module
        if (imp.module, imp.target) not in LATE_IMPORT_EXCEPTIONS
    ]
    return list(dict.fromkeys(found))


def _packages_run(importer: str, target: str, known: Iterable[str]) -> list[str]:
    """The packages whose ``__init__`` importing ``target`` runs first, from ``importer`` outside them.

    ``import a.b.c`` (or ``from a.b import c``) runs ``a/__init__`` and ``a/b/__init__`` before
    ``a.b.c``; a module inside ``a.b`` finds them already running, so they are not counted for it.
    """
    parts = target.split(".")
    return [
        package
        for package in (".".join(parts[:n]) for n in range(1, len(parts)))
        if package in known and importer != package and not importer.startswith(package + ".")
    ]


def import_graph(found: Iterable[Import], known: Iterable[str]) -> dict[str, dict[str, str]]:
    """Each torpor module's edges (target -> where): the modules it imports and the packages that import runs."""
    names = set(known)
    graph: dict[str, dict[str, str]] = {}
    for imp in found:
        if not is_torpor(imp.target) or imp.target == imp.module:
            continue
        for target in (*_packages_run(imp.module, imp.target, names), imp.target):
            graph.setdefault(imp.module, {}).setdefault(target, imp.where)
    return graph


def cycles(graph: dict[str, dict[str, str]] | None = None) -> list[str]:
    """Import cycles between modules over every edge: runtime, ``TYPE_CHECKING`` and ``importlib`` imports alike.

    A loop closed by a ``TYPE_CHECKING`` import or a call to ``importlib`` runs no code at
    import time, but it is still two modules that each need the other: a design loop. An
    import of a package's module counts the package's ``__init__`` too (:func:`import_graph`).
    """
    graph = import_graph(all_imports(), modules()) if graph is None else graph
    found: list[str] = []
    seen: set[frozenset[str]] = set()
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                loop = [*stack[stack.index(nxt) :], nxt]
                key = frozenset(loop)
                if key not in seen:
                    seen.add(key)
                    steps = ", ".join(f"{a} -> {b} ({graph[a][b]})" for a, b in itertools.pairwise(loop))
                    found.append(steps)
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return found


def test_every_module_is_in_a_layer() -> None:
    """Every module under torpor/ is placed in exactly one layer of the table."""
    for module in modules():
        layer_of(module)


#: The most lines a module of torpor may have (issue 17: small modules, one job each).
MAX_MODULE_LINES = 400


def test_no_module_is_over_the_line_limit() -> None:
    """No module under torpor/ has more than MAX_MODULE_LINES lines."""
    over = [
        f"{name}: {n} lines"
        for name, path in sorted(modules().items())
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not over, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(over)


#: Module basenames still used twice, with the modules that use them; every other repeat fails.
BASENAME_REPEATS_ALLOWED: dict[str, list[str]] = {}


def repeated_basenames(names: dict[str, Path]) -> dict[str, list[str]]:
    """Module basenames (a package's ``__init__`` aside) that more than one module under torpor/ uses, with those modules."""
    seen: dict[str, list[str]] = {}
    for name, path in sorted(names.items()):
        if path.name != "__init__.py":
            seen.setdefault(path.stem, []).append(name)
    return {base: found for base, found in seen.items() if len(found) > 1}


def test_no_module_basename_twice() -> None:
    """No two modules under torpor/ share a file name (but BASENAME_REPEATS_ALLOWED's, until renamed): a name says one thing."""
    twice = repeated_basenames(modules())
    new = {base: found for base, found in twice.items() if BASENAME_REPEATS_ALLOWED.get(base) != found}
    assert not new, "module basenames used more than once under torpor/:\n" + "\n".join(
        f"{base}: {', '.join(found)}" for base, found in sorted(new.items())
    )
    gone = sorted(set(BASENAME_REPEATS_ALLOWED) - set(twice))
    assert not gone, f"no longer repeated: remove {gone} from BASENAME_REPEATS_ALLOWED"


def test_the_basename_check_catches_a_repeat(tmp_path: Path) -> None:
    """Two files called errors.py in two packages are named; __init__.py files are not a repeat."""
    names = {
        "torpor.errors": tmp_path / "errors.py",
        "torpor.allocator.errors": tmp_path / "allocator" / "errors.py",
        "torpor.allocator": tmp_path / "allocator" / "__init__.py",
        "torpor.hooks": tmp_path / "hooks" / "__init__.py",
    }
    assert repeated_basenames(names) == {"errors": ["torpor.allocator.errors", "torpor.errors"]}


#: The CUDA VMM calls: made in one layer only, the native library's CUDA driver (csrc/driver_cuda.c).
VMM_CALLS = (
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemRelease",
)
CSRC = PACKAGE / "allocator" / "native" / "csrc"

#: Python modules under torpor/ that make VMM calls through cuda-bindings, with the reason.
VMM_EXCEPTIONS: dict[str, str] = {
    "torpor.bench.systems": (
        "the benchmark's vLLM-style baseline: vLLM's CuMemAllocator approach, written in Python on purpose "
        "as the system torpor is compared with, not torpor's allocator"
    ),
    "torpor.bench.realmodel": "the real-model benchmark's vLLM-style baseline (torpor.bench.systems's, for a discarded tag)",
}


def vmm_names(path: Path) -> list[str]:
    """Where a Python module names a VMM call in code (a name, an attribute, a string that is one): ``file:line name``."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(tree):
        name = (
            node.id
            if isinstance(node, ast.Name)
            else node.attr
            if isinstance(node, ast.Attribute)
            else node.value
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            else None
        )
        if name is not None and name.removesuffix("_v2") in VMM_CALLS:
            found.append(f"{where}:{getattr(node, 'lineno', 0)} {name}")
    return found


def _c_code(path: Path) -> str:
    """A C source without its comments."""
    text = path.read_text()
    out, i = [], 0
    while i < len(text):
        if text.startswith("/*", i):
            i = text.find("*/", i + 2) + 2 if text.find("*/", i + 2) >= 0 else len(text)
        elif text.startswith("//", i):
            i = text.find("\n", i) if text.find("\n", i) >= 0 else len(text)
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def test_the_vmm_driver_calls_are_made_in_one_layer() -> None:
    """cuMemCreate, cuMemMap, ... are called in the C CUDA driver only: no other C source, no torpor Python module."""
    code = {p.name: _c_code(p) for p in sorted(CSRC.glob("*.[ch]"))}
    missing = [c for c in VMM_CALLS if not re.search(rf"\b{c}\b", code["driver_cuda.c"])]
    assert not missing, f"csrc/driver_cuda.c makes no {missing}: where did the VMM calls go?"
    elsewhere = [f"csrc/{n}: {c}" for n, t in code.items() if n != "driver_cuda.c" for c in VMM_CALLS if c in t]
    assert not elsewhere, "VMM calls outside the CUDA driver table:\n" + "\n".join(elsewhere)
    named = {name: vmm_names(path) for name, path in modules().items()}
    python = [hit for name, hits in named.items() if name not in VMM_EXCEPTIONS for hit in hits]
    assert not python, "Python modules under torpor/ that make VMM calls (the native library does):\n" + "\n".join(
        python
    )
    stale = sorted(name for name in VMM_EXCEPTIONS if not named.get(name))
    assert not stale, f"VMM_EXCEPTIONS lists modules that make no VMM call any more: {stale}"


def test_the_vmm_check_catches_a_python_vmm_call(tmp_path: Path) -> None:
    """A module calling cuda-bindings' cuMemMap (or naming it as a string) is found with its file and line."""
    source = tmp_path / "probe.py"
    source.write_text(
        '"""Maps with cuMemMap (prose is fine)."""\n\n'
        'def f(cu):\n    cu.cuMemMap(0, 0, 0, 0, 0)\n    return getattr(cu, "cuMemRelease")\n'
    )
    assert vmm_names(source) == ["probe.py:4 cuMemMap", "probe.py:5 cuMemRelease"]


def test_imports_go_down_the_layers() -> None:
    """A module imports only from its own layer or a lower one (file:line of each offender)."""
    offenders = layer_violations()
    assert not offenders, "imports against the layer direction:\n" + "\n".join(offenders)


def test_parts_of_a_package_import_down_its_list() -> None:
    """Inside statemachine and allocator, a part imports only itself or an earlier part (TYPE_CHECKING too)."""
    offenders = subpackage_violations()
    assert not offenders, "imports against SUBPACKAGES:\n" + "\n".join(offenders)


def test_every_module_of_a_layered_package_is_in_a_part() -> None:
    """Each module of statemachine and allocator lies in one of its package's named parts."""
    stray = [
        m
        for m in modules()
        for package, parts in SUBPACKAGES.items()
        if (part := _part(m, package)) is not None and part not in parts
    ]
    assert not stray, f"modules in no part of SUBPACKAGES: {stray}"


def test_no_import_cycles() -> None:
    """No two torpor modules import each other, directly or through others, TYPE_CHECKING and importlib included."""
    found = cycles()
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_cycle_check_counts_a_packages_init() -> None:
    """``from p import b`` from outside ``p`` runs ``p/__init__``: a loop through it is found; a sibling's import is not."""
    known = ["torpor.p", "torpor.p.a", "torpor.p.b", "torpor.q", "torpor.q.c"]
    edges = [
        ("torpor.p", "torpor.p.a"),  # the facade imports its modules
        ("torpor.p.a", "torpor.p.b"),  # a sibling: p/__init__ is already running, no loop
        ("torpor.p.a", "torpor.q.c"),  # importlib, say
        ("torpor.q.c", "torpor.p.b"),  # from torpor.p import b: runs p/__init__, which imports p.a
    ]
    imps = [Import(m, t, f"{m}:1", False, False) for m, t in edges]
    graph = import_graph(imps, known)
    assert graph["torpor.p.a"] == {
        "torpor.p.b": "torpor.p.a:1",
        "torpor.q": "torpor.p.a:1",
        "torpor.q.c": "torpor.p.a:1",
    }
    assert cycles(graph) == [
        "torpor.p -> torpor.p.a (torpor.p:1), torpor.p.a -> torpor.q.c (torpor.p.a:1), "
        "torpor.q.c -> torpor.p (torpor.q.c:1)"
    ]
    assert cycles(import_graph(imps[:3], known)) == []


def test_no_function_level_torpor_imports() -> None:
    """No torpor module is imported inside a function (the way a cycle gets hidden)."""
    found = late_imports()
    assert not found, "function-level imports of torpor modules:\n" + "\n".join(found)


def test_every_late_import_exception_is_still_needed() -> None:
    """Each entry of LATE_IMPORT_EXCEPTIONS names a function-level import that exists."""
    late = {(i.module, i.target) for i in all_imports() if i.late and is_torpor(i.target)}
    stale = sorted(set(LATE_IMPORT_EXCEPTIONS) - late)
    assert not stale, f"LATE_IMPORT_EXCEPTIONS lists imports that are gone: {stale}"


def test_core_has_no_torch_threads_or_io_machinery() -> None:
    """The core layer imports no torch, threading, sockets, subprocesses or signals."""
    offenders = [
        f"{imp.where}: {imp.module} imports {imp.target}"
        for imp in all_imports()
        if layer_of(imp.module) == 0 and _in(imp.target, CORE_FORBIDDEN)
    ]
    assert not offenders, "the core imports I/O, threads or torch:\n" + "\n".join(offenders)


def test_statemachine_never_imports_torch() -> None:
    """No module of torpor.statemachine imports torch, at any level."""
    offenders = [
        f"{imp.where}: {imp.module} imports {imp.target}"
        for imp in all_imports()
        if _in(imp.module, ("torpor.statemachine",)) and _in(imp.target, ("torch",))
    ]
    assert not offenders, "torpor.statemachine imports torch:\n" + "\n".join(offenders)


def test_allocator_imports_no_controller_telemetry_or_hooks() -> None:
    """The allocator (mechanism) imports neither the controller, telemetry nor the hooks."""
    offenders = [
        f"{imp.where}: {imp.module} imports {imp.target}"
        for imp in all_imports()
        if _in(imp.module, ("torpor.allocator",))
        and is_torpor(imp.target)
        and (layer_of(imp.target) == 2 or _in(imp.target, ALLOCATOR_FORBIDDEN[1:]))
    ]
    assert not offenders, "the allocator imports policy or subscribers:\n" + "\n".join(offenders)


def test_capture_routing_imports_nothing_of_the_allocator() -> None:
    """torpor.hooks.capture imports no module of torpor.allocator (the capture vocabulary is torpor.graphcapture's)."""
    offenders = [
        f"{imp.where}: {imp.module} imports {imp.target}"
        for imp in all_imports()
        if imp.module == "torpor.hooks.capture" and _in(imp.target, ("torpor.allocator",))
    ]
    assert not offenders, "capture routing imports the allocator:\n" + "\n".join(offenders)


def test_the_capture_vocabulary_imports_no_allocator_controller_telemetry_or_hooks() -> None:
    """torpor.graphcapture, which the allocator and the hooks share, imports neither of them, the controller nor telemetry."""
    forbidden = ("torpor.allocator", *ALLOCATOR_FORBIDDEN[1:])
    offenders = [
        f"{imp.where}: {imp.module} imports {imp.target}"
        for imp in all_imports()
        if imp.module == "torpor.graphcapture"
        and is_torpor(imp.target)
        and (layer_of(imp.target) == 2 or _in(imp.target, forbidden))
    ]
    assert "torpor.graphcapture" in modules(), "torpor.graphcapture is gone: update this test"
    assert not offenders, "the capture vocabulary imports its users or policy:\n" + "\n".join(offenders)


#: The allocator's one way in: code outside torpor/allocator imports this package (its ``__init__``), nothing below.
ALLOCATOR_SURFACE = "torpor.allocator"

#: What code outside the allocator holds one under: a variable, an attribute, or the name ``getattr`` is given.
ALLOCATOR_NAMES = frozenset({"allocator", "_allocator", "alloc", "memory", "_memory"})


def _outside_allocator(found: dict[str, Path]) -> dict[str, Path]:
    return {m: p for m, p in found.items() if not _in(m, (ALLOCATOR_SURFACE,))}


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name}:{line}"


def allocator_internal_imports(found: dict[str, Path]) -> list[str]:
    """Imports (and module names in tables such as ``torpor._LAZY``) of the allocator's insides from outside it.

    ``file:line target`` for each ``import``/``from`` (``TYPE_CHECKING`` and ``importlib`` too) of a
    ``torpor.allocator.*`` module, and each string that names one where a docstring does not.
    """
    known = {**modules(), **found}
    inside = {m for m in known if m.startswith(ALLOCATOR_SURFACE + ".")}
    hits = []
    for module, path in sorted(_outside_allocator(found).items()):
        hits += [
            f"{_where(path, int(imp.where.rsplit(':', 1)[1]))} {imp.target}"
            for imp in imports(module, path, known)
            if imp.target.startswith(ALLOCATOR_SURFACE + ".")
        ]
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        hits += [
            f"{_where(path, node.lineno)} {node.value}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in inside and id(node) not in docstrings
        ]
    return sorted(set(hits))


def allocator_parts() -> set[str]:
    """What a ``TaggedAllocator`` holds beyond its public surface: each instance attribute, with and without its ``_``."""
    from torpor.allocator import TaggedAllocator

    with sim_rig() as rig:
        held = set(vars(rig.allocator))
    public = {name for name in dir(TaggedAllocator) if not name.startswith("_")}
    return {n for name in held for n in (name, name.lstrip("_"))} - public


def _getattr_name(node: ast.AST) -> str | None:
    """The literal name of a ``getattr(obj, "name", ...)`` call (None: not one)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return node.args[1].value
    return None


def _holds_allocator(node: ast.expr) -> bool:
    """Whether ``node`` reads as an allocator: a name, attribute or ``getattr`` of one of ALLOCATOR_NAMES."""
    if isinstance(node, ast.Name):
        return node.id in ALLOCATOR_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in ALLOCATOR_NAMES
    return _getattr_name(node) in ALLOCATOR_NAMES


def allocator_part_reads(found: dict[str, Path], parts: set[str]) -> list[str]:
    """Reads of an allocator's parts or private names from outside torpor/allocator: ``file:line name``.

    A read is ``allocator.NAME`` or ``getattr(allocator, "NAME")`` where the allocator is held under
    one of ALLOCATOR_NAMES and NAME is one of ``parts`` or starts with one underscore.
    """
    hits = []
    for path in _outside_allocator(found).values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _holds_allocator(node.value):
                name = node.attr
            elif isinstance(node, ast.Call) and (named := _getattr_name(node)) and _holds_allocator(node.args[0]):
                name = named
            else:
                continue
            if name in parts or (name.startswith("_") and not name.startswith("__")):
                hits.append(f"{_where(path, node.lineno)} {name}")
    return sorted(hits)


def test_nothing_outside_the_allocator_imports_its_insides() -> None:
    """Outside torpor/allocator, torpor imports ``torpor.allocator`` (its exports) and none of its subpackages or modules."""
    offenders = allocator_internal_imports(modules())
    assert not offenders, f"{len(offenders)} imports of the allocator's insides:\n" + "\n".join(offenders)


def test_nothing_outside_the_allocator_reads_its_parts() -> None:
    """Outside torpor/allocator, torpor reads a ``TaggedAllocator`` only through its public methods and properties."""
    offenders = allocator_part_reads(modules(), allocator_parts())
    assert not offenders, f"{len(offenders)} reads of an allocator's parts:\n" + "\n".join(offenders)


def test_the_facade_checks_catch_an_internal_import_and_a_part_read(tmp_path: Path) -> None:
    """A subpackage import, a lazy table naming a module, ``allocator.table`` and ``getattr(memory, "_book")`` are named."""
    source = tmp_path / "probe.py"
    source.write_text(
        '"""torpor.allocator.native.table in a docstring is no import."""\n'
        "from torpor.allocator import TaggedAllocator\n"
        "from torpor.allocator.native.table import NativeTable\n"
        '_LAZY = {"x": "torpor.allocator.tagged"}\n'
        "self.allocator.table.allocations()\n"
        'getattr(getattr(source, "memory", None), "_book", None)\n'
        "allocator.usage()\n"
    )
    assert allocator_internal_imports({"probe": source}) == [
        "probe.py:3 torpor.allocator.native.table",
        "probe.py:4 torpor.allocator.tagged",
    ]
    assert allocator_part_reads({"probe": source}, {"table"}) == ["probe.py:5 table", "probe.py:6 _book"]


def test_the_contract_catches_an_upward_import(tmp_path: Path) -> None:
    """A core module importing the controller is named with its file and line."""
    path = PACKAGE / "statemachine" / "core" / "events.py"
    fake = imports("torpor.statemachine.core.events", path, modules())
    assert all(layer_of(i.target) == 0 for i in fake if is_torpor(i.target))
    source = tmp_path / "probe.py"
    source.write_text("import os\n\ndef f():\n    from torpor.statemachine.machine import controller\n")
    found = imports("torpor.statemachine.core.events", source, modules())
    (late,) = [i for i in found if is_torpor(i.target)]
    assert late.late and late.target == "torpor.statemachine.machine.controller" and late.where.endswith("probe.py:4")
    assert layer_of(late.target) > layer_of(late.module)


def test_the_contract_counts_type_checking_and_importlib_edges(tmp_path: Path) -> None:
    """An import under TYPE_CHECKING and an importlib call of a literal name are both edges, the latter late."""
    source = tmp_path / "probe.py"
    source.write_text(
        "import importlib\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    from torpor.statemachine.machine import controller\n\n"
        "def f():\n    return importlib.import_module('torpor.torchgroup')\n"
    )
    found = [i for i in imports("torpor.statemachine.machine.group", source, modules()) if is_torpor(i.target)]
    typing_edge, dynamic = found
    assert typing_edge.typing_only and typing_edge.target == "torpor.statemachine.machine.controller"
    assert dynamic.late and dynamic.target == "torpor.torchgroup" and dynamic.where.endswith("probe.py:8")
    assert layer_of(dynamic.target) > layer_of(dynamic.module)


MACHINE = PACKAGE / "statemachine" / "machine"

#: Assignments in torpor.statemachine.machine to an attribute of an object other than ``self``, with the reason.
FOREIGN_STATE_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("torpor.statemachine.machine.controller", "group"): (
        "the vLLM backend joins a group after the controller is made (controller.group = ...): the controller's "
        "group setter hands the member to the context, which owns it"
    ),
}

#: Modules that record outside facts through the public ``SleepController.record(kind, **data)``, with the reason.
PUBLIC_RECORD_CALLERS: dict[str, str] = {
    "torpor.hooks._record": "a hook's decision, through the public record() API (hook_decision)",
    "torpor.hooks.vllm.wiring": "the vLLM wiring's hook decisions, through the public record() API",
    "torpor.tms.pausing": "torch_memory_saver's hook decision, through the public record() API",
    "torpor.keeper.kept": "a keeper's backup adopted, through the public record() API (backup_adopted)",
}


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def torpor_bases(path: Path, cls: str) -> list[str]:
    """The base classes of ``cls`` in ``path`` that are torpor's (defined there or imported from a torpor module)."""
    tree = ast.parse(path.read_text())
    torpor_names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torpor")
        for alias in node.names
    } | {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    node = _classes(path)[cls]
    return [ast.unparse(b) for b in node.bases if ast.unparse(b).split(".")[0] in torpor_names]


def test_sleep_controller_has_at_most_one_torpor_base_class() -> None:
    """SleepController is one class composed of parts it owns: at most one torpor base class (by source and by import)."""
    bases = torpor_bases(MACHINE / "controller.py", "SleepController")
    assert len(bases) <= 1, f"SleepController inherits {bases}: compose parts instead"
    from torpor.statemachine.machine.controller import SleepController

    inherited = [k.__qualname__ for k in SleepController.__mro__[1:] if k.__module__.startswith("torpor")]
    assert len(inherited) <= 1, f"SleepController's MRO holds torpor classes {inherited}"


ALLOCATOR = PACKAGE / "allocator"


def test_tagged_allocator_has_at_most_one_torpor_base_class() -> None:
    """TaggedAllocator is one class composed of parts it owns: at most one torpor base class (by source and by import)."""
    bases = torpor_bases(ALLOCATOR / "tagged.py", "TaggedAllocator")
    assert len(bases) <= 1, f"TaggedAllocator inherits {bases}: compose parts instead"
    from torpor.allocator.tagged import TaggedAllocator

    inherited = [k.__qualname__ for k in TaggedAllocator.__mro__[1:] if k.__module__.startswith("torpor")]
    assert len(inherited) <= 1, f"TaggedAllocator's MRO holds torpor classes {inherited}"


def stubs(path: Path) -> list[str]:
    """Methods whose body raises ``NotImplementedError`` (a "provided by" stub of a mixin): ``file:line name``."""
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    return [
        f"{where}:{node.lineno} {node.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef)
        for stmt in node.body
        if isinstance(stmt, ast.Raise) and stmt.exc is not None and "NotImplementedError" in ast.unparse(stmt.exc)
    ]


def test_the_allocator_has_no_provided_by_stubs() -> None:
    """No method under torpor/allocator raises NotImplementedError for another class to provide: parts are handed in."""
    offenders = [
        line for name, path in sorted(modules().items()) if name.startswith("torpor.allocator") for line in stubs(path)
    ]
    assert not offenders, "stubs that a mixin's partner provides:\n" + "\n".join(offenders)


def test_the_stub_check_catches_a_provided_by_stub(tmp_path: Path) -> None:
    """``def f(self): raise NotImplementedError`` is named with its file and line; a raise of another error is not."""
    source = tmp_path / "probe.py"
    source.write_text(
        "class A:\n    def f(self):  # provided by B\n        raise NotImplementedError\n\n"
        "    def g(self):\n        raise ValueError('no')\n"
    )
    assert stubs(source) == ["probe.py:2 f"]


def _flat(text: str) -> str:
    """Source text with comment marks and line breaks gone (a note's name may wrap in a docstring or a comment)."""
    return " ".join(line.strip().lstrip("#").strip() for line in text.splitlines())


def test_every_named_invariant_is_referenced_from_the_code() -> None:
    """Each "### Invariant: <name>" of docs/architecture.md is named ("Invariant: <name>") by a module under torpor/."""
    names = re.findall(r"^### Invariant: (.+)$", DOC.read_text(), flags=re.MULTILINE)
    assert names, "docs/architecture.md names no invariants"
    code = " ".join(_flat(path.read_text()) for path in modules().values())
    unreferenced = [n for n in names if f"Invariant: {n}" not in code]
    assert not unreferenced, f"invariants no code refers to by name: {unreferenced}"


def test_the_base_class_check_counts_torpor_bases(tmp_path: Path) -> None:
    """torpor_bases names a base imported from torpor or defined beside it, not object or a stdlib class."""
    source = tmp_path / "probe.py"
    source.write_text(
        "import threading\nfrom torpor.statemachine.machine.gate import Gate\n\n"
        "class Local: ...\n\nclass C(Gate, Local, threading.Thread, object): ...\n"
    )
    assert torpor_bases(source, "C") == ["Gate", "Local"]


def foreign_state(path: Path, module: str) -> list[str]:
    """Assignments to a part's attribute from outside it (``self._gate.x = ``, ``ctx.x = ``, ``ctx.gate.x = ``): ``file:line attr``.

    A plain record a step owns (``progress.phase = ``) is its own; a part is reached through ``self.<part>`` or the context.
    """
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign | ast.AugAssign)
            else []
        )
        for t in targets:
            if not isinstance(t, ast.Attribute) or (module, t.attr) in FOREIGN_STATE_EXCEPTIONS:
                continue
            if isinstance(t.value, ast.Attribute) or (isinstance(t.value, ast.Name) and t.value.id == "ctx"):
                found.append(f"{where}:{node.lineno} {ast.unparse(t)}")
    return found


def test_each_part_of_the_controller_changes_only_its_own_state() -> None:
    """No module of the machine assigns another object's attribute: each part changes its state through its methods."""
    offenders = [
        line
        for name, path in sorted(modules().items())
        if name.startswith("torpor.statemachine.machine.")
        for line in foreign_state(path, name)
    ]
    assert not offenders, "state of another part assigned:\n" + "\n".join(offenders)


def test_the_foreign_state_check_catches_a_part_assigning_anothers(tmp_path: Path) -> None:
    """``ctx.gate.log_failure = ...``, ``self._gate.owner = ...`` and ``ctx.group = ...`` are named; ``self.x``, ``progress.phase`` not."""
    source = tmp_path / "probe.py"
    source.write_text(
        "def f(ctx, self, progress):\n    self.x = 1\n    ctx.gate.log_failure = 'x'\n    self._gate.owner = 2\n"
        "    progress.phase = 'release'\n    ctx.group = None\n"
    )
    assert foreign_state(source, "probe") == [
        "probe.py:3 ctx.gate.log_failure",
        "probe.py:4 self._gate.owner",
        "probe.py:6 ctx.group",
    ]


def init_state(path: Path, cls: str) -> set[str]:
    """The attributes ``cls.__init__`` sets on ``self`` (a dataclass: its fields)."""
    node = _classes(path)[cls]
    fields = {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is None:
        return fields
    return fields | {
        t.attr
        for sub in ast.walk(init)
        for t in (
            sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        )
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


#: The controller and the parts it owns: (module, class); docs/architecture.md's parts table lists their state.
CONTROLLER_PARTS = (
    ("controller", "SleepController"),
    ("recorder", "Recorder"),
    ("gate", "Gate"),
    ("context", "Context"),
    ("hostmem", "HostSide"),
    ("group", "GroupMember"),
)


def test_the_controllers_parts_and_their_state_are_documented() -> None:
    """Every attribute the controller and each part it owns set in __init__ is in docs/architecture.md's parts table."""
    documented = DOC.read_text()
    missing = sorted(
        f"{cls}.{a}"
        for module, cls in CONTROLLER_PARTS
        for a in init_state(MACHINE / f"{module}.py", cls)
        if f"`{a}`" not in documented
    )
    assert not missing, f"docs/architecture.md's table of the controller's parts lacks {missing}"
    assert {"_recorder", "_gate", "_ctx"} <= init_state(MACHINE / "controller.py", "SleepController")


def untyped_events(path: Path, module: str) -> list[str]:
    """Events built from keyword arguments: ``_emit(...)``, ``record(EventKind.X, ...)``: ``file:line``."""
    where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        kind_first = bool(node.args) and ast.unparse(node.args[0]).startswith("EventKind.")
        if name == "_emit" or (
            name == "record" and (kind_first or node.keywords) and module not in PUBLIC_RECORD_CALLERS
        ):
            found.append(f"{where}:{node.lineno} {ast.unparse(node.func)}(...)")
    return found


def test_events_are_built_typed_where_produced() -> None:
    """No producer under torpor/ builds an event from keyword arguments: each builds its kind's payload class."""
    offenders = [line for name, path in sorted(modules().items()) for line in untyped_events(path, name)]
    assert not offenders, "events built from keyword arguments (build the payload class):\n" + "\n".join(offenders)


def test_every_public_record_caller_is_still_one() -> None:
    """Each module of PUBLIC_RECORD_CALLERS still calls record(EventKind.X, ...)."""
    stale = [m for m in PUBLIC_RECORD_CALLERS if not untyped_events(modules()[m], "a producer")]
    assert not stale, f"PUBLIC_RECORD_CALLERS lists modules that no longer call record(EventKind...): {stale}"


def test_the_typed_event_check_catches_keyword_events(tmp_path: Path) -> None:
    """``self._emit(EventKind.X, a=1)`` and ``note.record(kind, a=1)`` are named; ``ctx.record(TagReleased(...))`` is not."""
    source = tmp_path / "probe.py"
    source.write_text(
        "def f(self, note, ctx):\n    self._emit(EventKind.CLOSED, state='x')\n    note.record(kind, a=1)\n"
        "    ctx.record(TagReleased(tag='w', bytes=1))\n    driver.record(device)\n"
    )
    assert untyped_events(source, "probe") == ["probe.py:2 self._emit(...)", "probe.py:3 note.record(...)"]


#: The most files a ``sleep(1)`` passes through, above the native layer, on its way to a driver call.
SPINE_FILES = 5
NATIVE = PACKAGE / "allocator" / "native"


@functools.cache
def _torpor_file(filename: str) -> str | None:
    """``filename`` relative to torpor/ (``allocator/tagged.py``), None for a file outside it."""
    path = Path(filename).resolve()
    return path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else None


class _Library:
    """The native library, each call noting whether the simulated device saw a driver call while it ran."""

    def __init__(self, lib: Any, sim: int) -> None:
        self._lib = lib
        self._sim = sim

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn, count, sim = getattr(self._lib, name), self._lib.tp_sim_log, self._sim

        def library_call(*args: Any) -> Any:
            before, drove = count(sim, 0, None, 0), False
            try:
                return fn(*args)
            finally:
                drove = count(sim, 0, None, 0) > before  # read by the profiler at the return  # noqa: F841

        return library_call


_LIBRARY_CALL = next(c for c in _Library.__getattr__.__code__.co_consts if isinstance(c, CodeType))


@dataclass
class SleepTrace:
    """What a traced ``sleep(1)`` went through: the spine, the native files at the driver calls, the hops."""

    spine: set[str]  # torpor files outside native/ on the stack, from sleep() down, at each driver call
    native: set[str]  # the native files on the stack at those calls
    driver_calls: int  # library calls during which the driver was called
    hops: int  # calls from one torpor file into another


def trace_sleep() -> SleepTrace:
    """``sleep(1)`` of a controller over a ``TaggedAllocator`` on the simulated device, traced with ``sys.setprofile``.

    Four tags, ten allocations; the sleep traced is the second (its host chunks pinned by the first,
    as in an engine that has slept before, so no thread pins or stages while it runs).
    """
    stacks: dict[int, tuple[str, ...] | None] = {}
    trace = SleepTrace(set(), set(), 0, 0)
    sleep_code = SleepController.sleep.__code__

    def stack(frame: FrameType | None) -> tuple[str, ...] | None:  # torpor files from sleep() down; None: not in it
        files: list[str] = []
        while frame is not None:
            if (name := _torpor_file(frame.f_code.co_filename)) is not None:
                files.append(name)
            if frame.f_code is sleep_code:
                return tuple(files)
            frame = frame.f_back
        return None

    def profile(frame: FrameType, event: str, _: object) -> None:
        if frame.f_code is _LIBRARY_CALL:
            if event == "call":
                stacks[id(frame)] = stack(frame.f_back)
            elif event == "return" and (files := stacks.pop(id(frame))) is not None and frame.f_locals["drove"]:
                trace.driver_calls += 1
                trace.spine |= {f for f in files if not (PACKAGE / f).is_relative_to(NATIVE)}
                trace.native |= {f for f in files if (PACKAGE / f).is_relative_to(NATIVE)}
            return
        if event == "call" and frame.f_back is not None:
            callee, caller = _torpor_file(frame.f_code.co_filename), _torpor_file(frame.f_back.f_code.co_filename)
            trace.hops += int(callee is not None and caller is not None and callee != caller)

    with sim_rig() as rig:
        tags = {"weights": [64, 64, 128, 192], "kv_cache": [128] * 3, "workspace": [64], "cudagraph": [64] * 2}
        for tag, kib in tags.items():
            fill(rig.allocator, tag, [n << 10 for n in kib])
        controller = rig.control(policy=Policy(host=HostMemoryPolicy()))
        controller.sleep(1)
        controller.wake()
        table = rig.allocator._table  # the native table, instrumented
        table.lib = _Library(table.lib, rig.driver.native_sim)
        rig.driver.lib = _Library(rig.driver.lib, rig.driver.native_sim)
        before = sys.getprofile()
        sys.setprofile(profile)
        try:
            controller.sleep(1)
        finally:
            sys.setprofile(before)
    return trace


def test_a_sleep_reaches_the_driver_through_at_most_five_files() -> None:
    """A traced sleep(1) reaches each driver call through at most SPINE_FILES torpor files above the native layer."""
    trace = trace_sleep()
    assert trace.driver_calls, "the traced sleep made no driver call"
    assert {"statemachine/machine/controller.py", "allocator/sleepwake/cycle.py"} <= trace.spine, trace.spine
    assert trace.native <= {"allocator/native/table.py", "allocator/native/driver.py", "allocator/native/sim_driver.py"}
    assert len(trace.spine) <= SPINE_FILES, (
        f"sleep(1) reaches the driver through {len(trace.spine)} files, over {SPINE_FILES}: {sorted(trace.spine)} "
        f"({trace.hops} hops between torpor files)"
    )


def test_docs_architecture_has_the_layer_table() -> None:
    """docs/architecture.md's layer table is the one LAYERS generates."""
    text = DOC.read_text()
    assert BEGIN in text and END in text, "docs/architecture.md lost its layer markers"
    assert text == rendered_doc(text), "docs/architecture.md is stale: run python scripts/architecture.py"


def test_docs_architecture_module_map_is_the_codes() -> None:
    """docs/architecture.md's module map (rooms, their modules, the rooms each imports) is the one the imports give."""
    text = DOC.read_text()
    assert MAP_BEGIN in text and MAP_END in text, "docs/architecture.md lost its module-map markers"
    assert "](img/architecture" not in text, "the module map is text generated from the code, not a picture"
    assert text == rendered_doc(text), "docs/architecture.md is stale: run python scripts/architecture.py"


#: Standard exceptions torpor raises for a protocol's sake, each with its reason: (module, exception) -> why.
STANDARD_RAISES_ALLOWED: dict[tuple[str, str], str] = {
    ("torpor", "AttributeError"): "the module's __getattr__ (PEP 562): hasattr and from-imports expect AttributeError",
    (
        "torpor.tms",
        "AttributeError",
    ): "the module's __getattr__ (PEP 562): hasattr and from-imports expect AttributeError",
    ("torpor.tms.binarywrapper", "AttributeError"): "a library object's __getattr__: getattr and hasattr expect it",
    ("torpor.tms.tmsrun", "SystemExit"): "the process's exit status under python -m",
    ("torpor.commands", "ArgumentTypeError"): "an argparse type= converter: argparse turns it into a usage error",
    ("torpor.commands.bench", "ArgumentTypeError"): "an argparse type= converter: argparse turns it into a usage error",
    ("torpor.commands.demo", "ArgumentTypeError"): "an argparse type= converter: argparse turns it into a usage error",
    (
        "torpor.commands.keeper",
        "ArgumentTypeError",
    ): "an argparse type= converter: argparse turns it into a usage error",
    ("torpor.commands.log", "ArgumentTypeError"): "an argparse type= converter: argparse turns it into a usage error",
    (
        "torpor.commands.status",
        "ArgumentTypeError",
    ): "an argparse type= converter: argparse turns it into a usage error",
}


def torpor_error_names(found: dict[str, Path]) -> set[str]:
    """Names of the classes under torpor/ that derive from TorporError, by their bases' names (read, not imported)."""
    bases: dict[str, set[str]] = {}
    for path in found.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(ast.unparse(b).rpartition(".")[2] for b in node.bases)
    errors = {"TorporError"}
    while grown := {name for name, of in bases.items() if of & errors} - errors:
        errors |= grown
    return errors


def standard_raises(found: dict[str, Path], errors: set[str]) -> list[str]:
    """Each ``raise X``/``raise X(...)`` whose X is not in ``errors``, and each standard exception built: ``file:line X``.

    ``raise`` alone and ``raise exc`` (a lower-case name: an exception caught or built before) are re-raises;
    STANDARD_RAISES_ALLOWED's raises are not named.
    """
    import builtins

    standard = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    hits = set()
    for module, path in found.items():
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(ast.parse(path.read_text())):
            target: ast.expr | None = None
            if isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in standard:
                target = node.func
            if not isinstance(target, ast.Name | ast.Attribute):
                continue
            name = ast.unparse(target).rpartition(".")[2]
            if (
                name not in errors
                and not name.lstrip("_")[:1].islower()
                and (module, name) not in STANDARD_RAISES_ALLOWED
            ):
                hits.add(f"{where}:{node.lineno} {name}")
    return sorted(hits, key=lambda hit: (hit.partition(":")[0], int(hit.partition(":")[2].partition(" ")[0])))


def test_every_error_torpor_raises_is_a_torpor_error() -> None:
    """Every exception torpor raises derives from TorporError (beside the standard base it stands for), but the protocol ones listed."""
    found = modules()
    offenders = standard_raises(found, torpor_error_names(found))
    assert not offenders, f"{len(offenders)} raises of an exception that is no TorporError:\n" + "\n".join(offenders)


def test_every_allowed_standard_raise_is_still_made() -> None:
    """Each STANDARD_RAISES_ALLOWED entry names a module that still raises that standard exception."""
    found = modules()
    stale = [
        (module, name)
        for module, name in STANDARD_RAISES_ALLOWED
        if not any(
            isinstance(node, ast.Raise) and node.exc is not None and name in ast.unparse(node.exc)
            for node in ast.walk(ast.parse(found[module].read_text()))
        )
    ]
    assert not stale, f"STANDARD_RAISES_ALLOWED lists raises no longer made: {stale}"


def test_the_raise_check_catches_a_standard_exception(tmp_path: Path) -> None:
    """``raise ValueError(msg)``, ``err = KeyError(k)`` and ``raise RuntimeError`` are named; a TorporError and a re-raise are not."""
    source = tmp_path / "probe.py"
    source.write_text(
        "class TorporError(Exception): ...\nclass Refused(TorporError, ValueError): ...\n"
        "def f(msg, exc):\n    raise ValueError(msg)\n    err = KeyError(msg)\n    raise Refused(msg)\n"
        "    raise exc\n    raise\n    raise RuntimeError\n"
    )
    found = {"probe": source}
    assert standard_raises(found, torpor_error_names(found)) == [
        "probe.py:4 ValueError",
        "probe.py:5 KeyError",
        "probe.py:9 RuntimeError",
    ]


def _torpor_constants(tree: ast.Module) -> dict[str, str]:
    """A module's own constants that name a ``TORPOR_*`` variable: ``NAME = "TORPOR_..."`` -> the variable."""
    return {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        and node.value.value.startswith("TORPOR_")
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }


def _torpor_variable(arg: ast.expr, known: dict[str, str]) -> str | None:
    """The ``TORPOR_*`` variable ``arg`` names: a ``"TORPOR_..."`` literal, or a constant in ``known`` bound to one."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("TORPOR_"):
        return arg.value
    return known.get(arg.id) if isinstance(arg, ast.Name) else None


def environment_reads(found: dict[str, Path]) -> list[str]:
    """Each read of a ``TORPOR_*`` variable from an environment outside torpor/switches.py: ``file:line VARIABLE``.

    A read is ``os.environ.get(X)``, ``os.getenv(X)``, ``os.environ[X]``, ``X in os.environ`` (of any mapping:
    ``env.get(X)`` of a mapping passed in is one too), where X is a ``"TORPOR_..."`` literal or a constant bound to one (in the module, or
    imported from the torpor module that binds it). Writes (``os.environ[X] = ...``, ``pop``) are not reads.
    """
    trees = {module: ast.parse(path.read_text()) for module, path in found.items()}
    constants = {module: _torpor_constants(tree) for module, tree in trees.items()}
    hits = []
    for module, tree in sorted(trees.items()):
        if module == "torpor.switches":
            continue
        known = dict(constants[module])
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module in constants:
                known |= {
                    a.asname or a.name: constants[node.module][a.name]
                    for a in node.names
                    if a.name in constants[node.module]
                }

        path = found[module]
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        for node in ast.walk(tree):
            read: ast.expr | None = None
            if isinstance(node, ast.Call) and node.args:
                name = ast.unparse(node.func)
                if name in ("os.getenv", "getenv") or (
                    isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                ):
                    read = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                read = node.slice
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In | ast.NotIn):
                read = node.left
            if read is not None and (var := _torpor_variable(read, known)):
                hits.append(f"{where}:{node.lineno} {var}")
    return hits


def test_torpor_variables_are_read_only_through_torpor_switches() -> None:
    """No module but torpor.switches reads a ``TORPOR_*`` environment variable itself: one reading, one refusal each."""
    offenders = environment_reads(modules())
    assert not offenders, f"{len(offenders)} reads of TORPOR_* variables outside torpor.switches:\n" + "\n".join(
        offenders
    )


def test_the_environment_check_catches_a_direct_read(tmp_path: Path) -> None:
    """``os.environ.get("TORPOR_X")``, ``environ[ENV]`` and ``os.getenv(ENV)`` are named; a write and ``HOME`` are not."""
    source = tmp_path / "probe.py"
    source.write_text(
        'import os\nENV = "TORPOR_Y"\nos.environ.get("TORPOR_X")\nenviron[ENV]\nos.getenv(ENV)\n'
        'os.environ[ENV] = "1"\nos.environ.get("HOME")\nENV in os.environ\n'
    )
    assert environment_reads({"probe": source}) == [
        "probe.py:3 TORPOR_X",
        "probe.py:4 TORPOR_Y",
        "probe.py:5 TORPOR_Y",
        "probe.py:8 TORPOR_Y",
    ]


#: The byte units torpor/units.py defines, and no other module.
UNIT_NAMES = ("KiB", "MiB", "GiB", "TiB")


def unit_definitions(found: dict[str, Path]) -> list[str]:
    """Each module-level ``MiB = ...`` (any of UNIT_NAMES) outside torpor/units.py: ``file:line NAME``."""
    hits = []
    for module, path in sorted(found.items()):
        if module == "torpor.units":
            continue
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            hits += [f"{where}:{node.lineno} {t.id}" for t in targets if isinstance(t, ast.Name) and t.id in UNIT_NAMES]
    return hits


def test_byte_units_have_one_home() -> None:
    """KiB, MiB, GiB and TiB are defined in torpor/units.py only; every other module imports them from there."""
    offenders = unit_definitions(modules())
    assert not offenders, f"{len(offenders)} byte units defined outside torpor/units.py:\n" + "\n".join(offenders)


def test_the_unit_check_catches_a_second_definition(tmp_path: Path) -> None:
    """``MiB = 1 << 20`` at module level is named; an import of MiB and a local inside a function are not."""
    source = tmp_path / "probe.py"
    source.write_text("from torpor.units import GiB\nMiB = 1 << 20\ndef f():\n    KiB = 1024\n")
    assert unit_definitions({"probe": source}) == ["probe.py:2 MiB"]


def event_constructors(path: Path) -> list[str]:
    """The module-level functions of ``path`` that return an ``Event`` (annotated ``-> Event``)."""
    return [
        node.name
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.returns is not None and ast.unparse(node.returns) == "Event"
    ]


def test_events_have_one_constructor() -> None:
    """torpor builds a new event one way: ``stamp(payload, ...)`` of a typed payload (no keyword-data builder beside it)."""
    assert event_constructors(PACKAGE / "statemachine" / "core" / "events.py") == ["stamp"]
