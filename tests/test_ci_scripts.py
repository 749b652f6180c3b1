"""Tests for the CI scripts (.ci/run, scripts/*): they parse, and the Prometheus install step runs as root and as a user."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [ROOT / ".ci" / "run", *sorted(p for p in (ROOT / "scripts").iterdir() if p.is_file())]
BASH = shutil.which("bash") or "/bin/bash"


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _install(tmp_path: Path, uid: int, *, apt: bool = True) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run scripts/install-prometheus with fake id, sudo and apt-get on a PATH without prometheus."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for tool in ("env", "head", "grep", "cat"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    _fake(bin_dir, "id", f'[ "$1" = -u ] && echo {uid}')
    _fake(bin_dir, "sudo", f'echo "sudo $*" >> {calls}; exec "$@"')
    if apt:
        _fake(bin_dir, "apt-get", f'echo "apt-get $* DEBIAN_FRONTEND=${{DEBIAN_FRONTEND:-unset}}" >> {calls}')
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
    """Every CI and helper script is valid bash (bash -n) and executable, as the README runs them."""
    assert os.access(script, os.X_OK), script
    done = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_install_as_root_runs_apt_get_directly(tmp_path: Path) -> None:
    """As root (containers) the install step runs apt-get itself, noninteractive, and succeeds (it exited 127 once)."""
    done, calls = _install(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    assert calls == [
        "apt-get update -qq DEBIAN_FRONTEND=noninteractive",
        "apt-get install -y -qq --no-install-recommends prometheus DEBIAN_FRONTEND=noninteractive",
    ]


def test_install_as_a_user_goes_through_sudo(tmp_path: Path) -> None:
    """As a normal user the install step runs apt-get through sudo, with DEBIAN_FRONTEND passed through env."""
    done, calls = _install(tmp_path, 1000)
    assert done.returncode == 0, done.stderr
    assert calls == [
        "sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq",
        "apt-get update -qq DEBIAN_FRONTEND=noninteractive",
        "sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus",
        "apt-get install -y -qq --no-install-recommends prometheus DEBIAN_FRONTEND=noninteractive",
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
