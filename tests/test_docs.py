"""Tests of the README and docs/ as a whole: the figures they quote, the tests they cite, the commands they list."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"

#: A figure with its unit: ``0.158 s``, ``1.01x``, ``0.29-0.30 s``, ``9.5-10.8 s``, ``47 GB/s``, ``12 minutes``.
FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))? ?(ms|s|x|GB/s|minutes)(?![\w/])")

#: A test cited by path: ``tests/test_x.py``, ``tests/test_x.py::test_y``, ``tests/test_x.py::Class::test_y[param]``.
CITATION = re.compile(r"\btests/(test_\w+\.py)((?:::\w+)*)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a block shows a program's output, not a figure the page states)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _figures(text: str) -> list[tuple[str, str, str]]:
    """Each endpoint of each figure in ``text`` as (figure as written, number, unit)."""
    found = []
    for match in FIGURE.finditer(text):
        low, high, unit = match.groups()
        found.extend((match.group(0), number, unit) for number in (low, high) if number is not None)
    return found


def _sourced(number: str, unit: str, sources: dict[str, set[float]]) -> bool:
    """Whether a figure of the sources, rounded to ``number``'s decimals, is ``number`` in the same unit."""
    decimals = len(number.partition(".")[2])
    return any(round(value, decimals) == float(number) for value in sources.get(unit, set()))


def unsourced_figures(page: str, source: str) -> list[str]:
    """The figures of ``page``'s prose whose endpoints no figure of ``source`` gives (rounded as ``page`` writes them)."""
    sources: dict[str, set[float]] = {}
    for _, number, unit in _figures(source):
        sources.setdefault(unit, set()).add(float(number))
    return sorted({figure for figure, number, unit in _figures(_prose(page)) if not _sourced(number, unit, sources)})


def test_the_figure_check_catches_a_figure_without_a_source() -> None:
    """The figure check passes a figure the source gives (rounded or as a range's ends) and names one it does not."""
    source = "first sleep 0.292 s (1.04x), later 0.296-0.299 s; wake 1.06x; `cumem` 10.750 s"
    page = "sleeps in 0.29-0.30 s at 1.04-1.06x (`cumem`: 10.8 s), wakes in 0.157 s at 1.01x\n```\nsleep 9.9 s\n```\n"
    assert unsourced_figures(page, source) == ["0.157 s", "1.01x"]


def test_readme_figures_are_the_benchmark_pages() -> None:
    """Every time, ratio and rate the README states is one docs/benchmarks.md gives (the end of a range included)."""
    assert unsourced_figures(README.read_text(), BENCHMARKS.read_text()) == []


def _defined(path: Path) -> set[str]:
    """The module-level function and class names of a test file, and ``Class::method`` for each method."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    return names


def missing_citations(text: str, tests: Path) -> list[str]:
    """The test citations in ``text`` whose file is not under ``tests`` or whose test that file does not define."""
    missing = []
    for match in CITATION.finditer(text):
        file, name = tests / match.group(1), match.group(2).removeprefix("::")
        if not file.exists() or (name and name not in _defined(file)):
            missing.append(match.group(0))
    return missing


def test_the_citation_check_catches_a_moved_test(tmp_path: Path) -> None:
    """The citation check passes a test that exists and names a missing file, a missing test and a missing method."""
    (tmp_path / "test_here.py").write_text(
        "def test_a():\n    pass\n\n\nclass TestB:\n    def test_c(self):\n        pass\n"
    )
    text = (
        "`tests/test_here.py::test_a`, tests/test_here.py::TestB::test_c[1], tests/test_here.py; "
        "tests/test_gone.py::test_a, tests/test_here.py::test_z, tests/test_here.py::TestB::test_a"
    )
    assert missing_citations(text, tmp_path) == [
        "tests/test_gone.py::test_a",
        "tests/test_here.py::test_z",
        "tests/test_here.py::TestB::test_a",
    ]


def test_every_test_the_docs_cite_exists() -> None:
    """Every ``tests/test_x.py::name`` (or ``tests/test_x.py``) cited by the README or docs/*.md names a test that exists."""
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    missing = {
        str(page.relative_to(ROOT)): found
        for page in pages
        if (found := missing_citations(page.read_text(), ROOT / "tests"))
    }
    assert missing == {}


def test_readme_command_table_lists_every_command() -> None:
    """The README's command-line table has a row for every subcommand ``torpor --help`` lists, and no other."""
    from torpor.cli import COMMANDS

    text = README.read_text()
    section = text[text.index("## The command line") :].split("\n## ", 1)[0]
    listed = {row.split()[0] for row in re.findall(r"^\| `torpor (\w[\w-]*)", section, re.MULTILINE)}
    assert listed == set(COMMANDS)


def test_every_torpor_command_the_docs_name_exists() -> None:
    """Every ``torpor WORD`` in a code span of the README or docs/**.md is a subcommand ``torpor --help`` lists."""
    from torpor.cli import COMMANDS

    pages = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = sorted(
        f"{page.relative_to(ROOT)}: `{span}`"
        for page in pages
        for span in re.findall(r"`([^`\n]+)`", page.read_text())
        for word in re.findall(r"(?:^|[\s;&|(])torpor ([a-z][\w-]*)", span)
        if word not in COMMANDS
    )
    assert unknown == []
