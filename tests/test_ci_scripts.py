"""Tests for the CI scripts (.ci/run, scripts/*): they parse, and the Prometheus install step runs as root and as a user."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from support import WITHOUT_TORCH

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [ROOT / ".ci" / "run", *sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())]
BASH = shutil.which("bash") or "/bin/bash"
LOCK = "-o DPkg::Lock::Timeout=600"  # a machine booted a minute ago may still run its own apt


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _install(
    tmp_path: Path, uid: int, *, apt: bool = True, apt_rc: int = 0, sudo: bool = True
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run scripts/install-prometheus with fake id, sudo and apt-get on a PATH without prometheus."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool in ("env", "head", "grep", "cat"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    _fake(bin_dir, "id", f'[ "$1" = -u ] && echo {uid}')
    if sudo:
        _fake(bin_dir, "sudo", f'echo "sudo $*" >> {calls}; [ "$1" = -n ] && shift; exec "$@"')
    if apt:
        _fake(
            bin_dir,
            "apt-get",
            f'echo "apt-get $* DEBIAN_FRONTEND=${{DEBIAN_FRONTEND:-unset}}" >> {calls}; exit {apt_rc}',
        )
    done = subprocess.run(
        [BASH, str(ROOT / "scripts" / "install-prometheus")],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    return done, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_parses_and_is_executable(script: Path) -> None:
    """Every CI and helper script is executable, as the README runs them, and valid in the language its #! names: bash (bash -n) or Python (compiled)."""
    assert os.access(script, os.X_OK), script
    shebang = script.read_text().partition("\n")[0]
    assert shebang in ("#!/usr/bin/env bash", "#!/usr/bin/env python3"), f"{script}: {shebang!r}"
    if shebang.endswith("python3"):
        compile(script.read_text(), str(script), "exec")
        return
    done = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_install_as_root_runs_apt_get_directly(tmp_path: Path) -> None:
    """As root (containers) the install step runs apt-get itself, noninteractive, and succeeds (it exited 127 once)."""
    done, calls = _install(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    assert calls == [
        f"apt-get {LOCK} update -qq DEBIAN_FRONTEND=noninteractive",
        f"apt-get {LOCK} install -y -qq --no-install-recommends prometheus DEBIAN_FRONTEND=noninteractive",
    ]


def test_install_as_a_user_goes_through_sudo(tmp_path: Path) -> None:
    """As a normal user the install step runs apt-get through sudo -n (no password prompt), DEBIAN_FRONTEND through env."""
    done, calls = _install(tmp_path, 1000)
    assert done.returncode == 0, done.stderr
    assert calls == [
        f"sudo -n env DEBIAN_FRONTEND=noninteractive apt-get {LOCK} update -qq",
        f"apt-get {LOCK} update -qq DEBIAN_FRONTEND=noninteractive",
        f"sudo -n env DEBIAN_FRONTEND=noninteractive apt-get {LOCK} install -y -qq --no-install-recommends prometheus",
        f"apt-get {LOCK} install -y -qq --no-install-recommends prometheus DEBIAN_FRONTEND=noninteractive",
    ]


def test_install_without_apt_get_says_so_and_continues(tmp_path: Path) -> None:
    """Without apt-get the step prints what to install and exits 0 (the prometheus tests then skip or fail loudly)."""
    done, calls = _install(tmp_path, 0, apt=False)
    assert done.returncode == 0
    assert calls == []
    assert "install prometheus and promtool yourself" in done.stderr


def test_ci_runs_the_install_step_and_the_rules_tests() -> None:
    """scripts/test installs Prometheus through the tested script and runs promtool on the shipped rules."""
    text = (ROOT / "scripts" / "test").read_text()
    assert "scripts/install-prometheus" in text
    assert "$SUDO" not in text
    assert "promtool test rules deploy/prometheus/torpor-rules.test.yml" in text


def test_install_when_apt_get_fails_says_so_in_one_line_and_lets_the_run_go_on(tmp_path: Path) -> None:
    """apt-get update failing (no network, a broken mirror): one line naming what is missing, exit 0, no install tried."""
    done, calls = _install(tmp_path, 0, apt_rc=100)
    assert done.returncode == 0, done.stderr
    assert calls == [f"apt-get {LOCK} update -qq DEBIAN_FRONTEND=noninteractive"]
    assert done.stderr.splitlines() == [
        "install-prometheus: apt-get update failed (above); the Prometheus checks need prometheus and promtool"
    ]


def test_install_as_a_user_without_sudo_says_so_in_one_line(tmp_path: Path) -> None:
    """A normal user on a machine without sudo: one line, exit 0, apt-get never run (it would only fail on the lock)."""
    done, calls = _install(tmp_path, 1000, sudo=False)
    assert done.returncode == 0 and calls == []
    assert done.stderr.splitlines() == [
        "install-prometheus: not root and no sudo; install prometheus and promtool yourself (the Prometheus checks need them)"
    ]


def _fake_checkout(tmp_path: Path, *, cc: bool = True) -> tuple[Path, Path, dict[str, str]]:
    """A copy of the CI scripts in a tree whose .venv tools are fakes recording their calls; PATH has no Prometheus."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".ci").mkdir()
    for rel in ("scripts/test", "scripts/install-prometheus", ".ci/run"):
        shutil.copy2(ROOT / rel, repo / rel)
    calls = tmp_path / "calls"
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    for tool in ("python", "ruff", "mypy"):
        _fake(venv, tool, f'echo "{tool} $* REQUIRE=${{TORPOR_REQUIRE_PROMETHEUS:-unset}}" >> {calls}')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("env", "head", "grep", "cat", "dirname", "bash"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    _fake(bin_dir, "id", '[ "$1" = -u ] && echo 0')
    if cc:
        _fake(bin_dir, "cc", "exit 0")
    return repo, calls, {"PATH": str(bin_dir), "HOME": str(tmp_path)}


def _run_test_script(repo: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASH, str(repo / "scripts" / "test")], env=env, capture_output=True, text=True, check=False)


def test_the_test_script_without_promtool_runs_the_tests_then_fails_saying_why(tmp_path: Path) -> None:
    """Off Debian (no apt-get, no promtool): every other check and the tests run, then it fails naming promtool."""
    repo, calls, env = _fake_checkout(tmp_path)
    done = _run_test_script(repo, env)
    assert done.returncode == 1, done.stderr
    assert "command not found" not in done.stderr
    assert [c for c in calls.read_text().splitlines() if c.startswith("python -m pytest")] == [
        "python -m pytest REQUIRE=1"
    ]
    said = [line for line in done.stderr.splitlines() if "promtool" in line]
    assert said[0].startswith("install-prometheus: no apt-get here")
    assert said[-1].startswith("scripts/test: prometheus/promtool not found") and "fail" in said[-1]


def test_the_test_script_skips_the_prometheus_checks_when_told_to(tmp_path: Path) -> None:
    """TORPOR_REQUIRE_PROMETHEUS=0 without promtool: one line says the checks are skipped; pytest skips them; exit 0."""
    repo, calls, env = _fake_checkout(tmp_path)
    done = _run_test_script(repo, {**env, "TORPOR_REQUIRE_PROMETHEUS": "0"})
    assert done.returncode == 0, done.stderr
    assert "python -m pytest REQUIRE=0" in calls.read_text().splitlines()
    assert [line for line in done.stderr.splitlines() if line.startswith("scripts/test:")] == [
        "scripts/test: prometheus/promtool not found: the rules checks and the prometheus tests are skipped"
        " (TORPOR_REQUIRE_PROMETHEUS=0)"
    ]


def test_the_test_script_without_a_c_compiler_fails_at_once_saying_so(tmp_path: Path) -> None:
    """No C compiler: one line names it before the build is tried; nothing after it runs."""
    repo, calls, env = _fake_checkout(tmp_path, cc=False)
    done = _run_test_script(repo, {**env, "TORPOR_REQUIRE_PROMETHEUS": "0"})
    assert done.returncode == 1
    assert "scripts/test: no C compiler" in done.stderr
    assert not [c for c in calls.read_text().splitlines() if "build_ext" in c or c.startswith("ruff")]


GPU_TEST_FILES = sorted(p.name for p in (ROOT / "tests").glob("test_*gpu*.py"))


@pytest.mark.parametrize("name", GPU_TEST_FILES)
def test_every_gpu_test_file_collects_and_skips_where_torch_is_missing(name: str) -> None:
    """Where torch is not installed, a GPU test file is collected and its tests skipped, never an error at collection."""
    argv = ["-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-rs", "-m", "gpu or gpu2 or not gpu", f"tests/{name}"]
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    tail = done.stdout[-2000:] + done.stderr[-1000:]
    assert "error" not in done.stdout.splitlines()[-1], tail
    assert done.returncode in (0, 5), tail
