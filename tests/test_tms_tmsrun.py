"""python -m torpor.tms.tmsrun: the switch on for a program and its Python children."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from torpor.tms import tmsrun


def test_prepare_sets_the_switch_and_the_boot_path() -> None:
    """prepare() sets TORPOR_TMS=1 and puts the boot directory first on PYTHONPATH, keeping what was there."""
    env = {"PYTHONPATH": "/a"}
    tmsrun.prepare(env)
    assert env["TORPOR_TMS"] == "1"
    assert env["PYTHONPATH"] == f"{tmsrun.BOOT}{os.pathsep}/a"
    assert (tmsrun.BOOT / "sitecustomize.py").is_file()


def test_usage_without_a_program() -> None:
    """No program (or -m without its module, or -c: torpor evaluates no code string) prints the usage and exits 2."""
    assert tmsrun.main([]) == 2
    assert tmsrun.main(["-m"]) == 2
    assert tmsrun.main(["-c", "print(1)"]) == 2


def test_runs_code_and_modules(tmp_path: Path) -> None:
    """A SCRIPT and -m MODULE run with the switch on, argv as python gives it."""
    script = tmp_path / "probe_script.py"
    script.write_text("import sys, torch_memory_saver as t; print('RAN', t.__name__, sys.argv[1:])\n")
    out = subprocess.run(
        [sys.executable, "-m", "torpor.tms.tmsrun", str(script), "x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "RAN torpor.tms ['x']" in out.stdout, out.stderr
    (tmp_path / "probe_mod.py").write_text("import torch_memory_saver as t\nprint('MOD', t.__name__)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "torpor.tms.tmsrun", "-m", "probe_mod"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert "MOD torpor.tms" in out.stdout, out.stderr
