"""Tests that every error class lives in torpor/errors.py and the old import paths still give it."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torpor"


#: Where each error class used to live; those paths keep working by re-export.
OLD_ERROR_PATHS = {
    "torpor.telemetry.feed": ("BadRequest",),
    "torpor.hooks.capture": ("CaptureRoutingError",),
    "torpor.hooks.vllm.facade": ("NotWired",),
    "torpor.hooks.vllm.activation": ("ActivationError",),
}


def _exception_names() -> set[str]:
    """Builtin exception names and the classes torpor/errors.py defines."""
    builtin = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)}
    builtin = {n for n in builtin if issubclass(getattr(builtins, n), BaseException)}
    tree = ast.parse((PACKAGE / "errors.py").read_text())
    return builtin | {node.name for node in tree.body if isinstance(node, ast.ClassDef)}


#: The one errors module of each optional integration package (loaded only by its users), and why it is not
#: torpor/errors.py: each class there derives from TorporError.
INTEGRATION_ERRORS = {
    "tms/tmserrors.py": "torch_memory_saver's API: errors its users' except clauses catch, imported with torpor.tms only",
    "keeper/refusals.py": "the keeper process and its wire protocol, imported with torpor.keeper only",
}


def test_every_error_class_lives_in_torpor_errors() -> None:
    """No module but torpor/errors.py (and one errors module per optional integration) defines an exception class."""
    exceptions = _exception_names()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "errors.py":
            continue
        if path.relative_to(PACKAGE).as_posix() in INTEGRATION_ERRORS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & exceptions:
                    offenders.append(f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: {node.name}")
    assert not offenders, "error classes outside torpor/errors.py:\n" + "\n".join(offenders)


def test_every_error_of_an_integration_is_a_torpor_error() -> None:
    """Each exception class of an integration's errors module derives from TorporError (one except clause catches all)."""
    import importlib

    from torpor.errors import TorporError

    for rel in INTEGRATION_ERRORS:
        module = importlib.import_module("torpor." + rel.removesuffix(".py").replace("/", "."))
        classes = [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
        assert classes, rel
        strays = [c.__name__ for c in classes if issubclass(c, BaseException) and not issubclass(c, TorporError)]
        assert not strays, f"{rel}: {strays} are no TorporError"


def test_old_error_paths_still_work() -> None:
    """Each moved error class is still importable from where it used to live, as the same class."""
    import importlib

    import torpor.errors

    for module, names in OLD_ERROR_PATHS.items():
        loaded = importlib.import_module(module)
        for name in names:
            assert getattr(loaded, name) is getattr(torpor.errors, name), f"{module}.{name}"


def test_bad_request_is_a_torpor_error_and_still_a_value_error() -> None:
    """BadRequest derives from TorporError and still from ValueError (existing except clauses catch it)."""
    from torpor.errors import BadRequest, TorporError

    assert issubclass(BadRequest, TorporError) and issubclass(BadRequest, ValueError)
