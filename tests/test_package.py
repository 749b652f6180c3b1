"""Tests for the package as a whole: layering, exports, and no runtime asserts."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def _pyproject() -> dict[str, object]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_and_spdx_metadata() -> None:
    """LICENSE holds the Apache-2.0 text, and pyproject declares it as an SPDX expression with license-files."""
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_version_is_written_once() -> None:
    """The version is written once, in torpor/_version.py (torpor.__version__ re-exports it): pyproject reads it (dynamic), CHANGELOG has a section for it."""
    data = _pyproject()
    project = data["project"]
    assert isinstance(project, dict)
    assert "version" not in project
    assert project["dynamic"] == ["version"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "torpor._version.__version__"}  # type: ignore[index]
    assert torpor.__version__ is torpor._version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]\d+|rc\d+)?", torpor.__version__)
    assert f"## [{torpor.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def test_metadata_has_classifiers_urls_and_keywords() -> None:
    """pyproject carries classifiers (with the license left to the SPDX field), project URLs and keywords."""
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    classifiers = project["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639: the expression says it
    assert {"Homepage", "Source", "Issues", "Changelog"} <= set(project["urls"])
    assert "vllm" in project["keywords"]


def test_torch_is_an_extra_not_a_dependency() -> None:
    """torch and cuda-bindings are in the cuda extra (the vllm extra includes it), not in the core dependencies."""
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    names = [re.split(r"[<>=!~\[ ;]", d)[0] for d in project["dependencies"]]
    assert "torch" not in names and "cuda-bindings" not in names
    extras = project["optional-dependencies"]
    assert {re.split(r"[<>=!~ ]", d)[0] for d in extras["cuda"]} == {"torch", "cuda-bindings"}
    assert "torpor[cuda]" in extras["vllm"]


def test_built_wheel_metadata(tmp_path: Path) -> None:
    """The wheel setuptools builds says License-Expression Apache-2.0, ships LICENSE, has the version, and needs no torch."""
    import shutil
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".gpu", ".whl", "out"),
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = tmp_path.glob("torpor-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    assert f"Version: {torpor.__version__}\n" in meta
    assert "License-Expression: Apache-2.0\n" in meta
    assert "License-File: LICENSE\n" in meta
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    for line in requires:
        if line.split()[1].startswith(("torch", "cuda-bindings")):
            assert 'extra == "cuda"' in line, line
    assert "Project-URL: Changelog" in meta


def _readme_build_commands() -> list[str]:
    return re.findall(r"`([^`\n]*setup\.py build_ext --inplace[^`\n]*)`", (ROOT / "README.md").read_text())


def test_readme_build_command_installs_the_build_requirements() -> None:
    """The README's `setup.py build_ext --inplace` first installs pyproject's build requirements into the README's venv."""
    requires = _pyproject()["build-system"]["requires"]  # type: ignore[index]
    commands = _readme_build_commands()
    assert commands, "README.md lost its `setup.py build_ext --inplace` command"
    for command in commands:
        build = command.index(".venv/bin/python setup.py build_ext --inplace") if ".venv/bin/python" in command else -1
        assert build >= 0, f"{command!r} does not run the README's venv (.venv/bin/python)"
        for requirement in requires:
            assert f".venv/bin/pip install '{requirement}' && " in command[:build], (command, requirement)


def _fresh_venv_setuptools(venv: Path) -> tuple[int, ...] | None:
    """The setuptools version a fresh ``python -m venv`` gets from ensurepip (offline), or None when it gets none."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import setuptools; print(setuptools.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return None
    return tuple(int(p) for p in re.findall(r"\d+", done.stdout)[:3])


def test_setup_py_under_an_old_setuptools_says_what_to_install(tmp_path: Path) -> None:
    """setup.py run by a fresh venv's older setuptools (65.5 on Python 3.11) stops with one line naming the requirement, no traceback."""
    import shutil

    version = _fresh_venv_setuptools(tmp_path / "venv")
    requires = _pyproject()["build-system"]["requires"]  # type: ignore[index]
    (needed,) = (int(m.group(1)) for r in requires if (m := re.fullmatch(r"setuptools>=(\d+)", r)))
    if version is None or version[0] >= needed:
        pytest.skip(f"a fresh venv here has setuptools {version}: not older than {needed}")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "python"), "setup.py", "build_ext", "--inplace"],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Traceback" not in out, out
    assert f"pip install 'setuptools>={needed}'" in out, out
    assert ".".join(map(str, version)) in out, out
