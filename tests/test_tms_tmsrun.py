"""python -m torpor.tms.tmsrun: the switch on for a program and its Python children."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torpor.tms import tmsrun

ROOT = Path(__file__).resolve().parent.parent


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


def tmsrun_cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m torpor.tms.tmsrun ARGS`` in ``cwd``, torpor importable from the checkout."""
    environ = {k: v for k, v in (env or os.environ).items() if k != "TORPOR_TMS"}
    environ["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "torpor.tms.tmsrun", *args]
    return subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=120, check=False)


def test_a_missing_script_is_one_line(tmp_path: Path) -> None:
    """A SCRIPT that does not exist is one line naming it and exit 2, as python says it, not a runpy traceback."""
    out = tmsrun_cli(["nope.py"], tmp_path)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        f"python -m torpor.tms.tmsrun: can't open file {str(tmp_path / 'nope.py')!r}: [Errno 2] No such file or directory"
    ]


def test_a_missing_module_is_one_line(tmp_path: Path) -> None:
    """-m MODULE that is not installed is one line naming it and exit 1, as python -m says it."""
    out = tmsrun_cli(["-m", "nope_no_such_module"], tmp_path)
    assert out.returncode == 1
    assert out.stderr.splitlines() == ["python -m torpor.tms.tmsrun: No module named nope_no_such_module"]


def test_dash_c_says_why_it_is_refused(tmp_path: Path) -> None:
    """-c is refused with the reason (torpor runs no code string) and what to do, then the usage; exit 2."""
    out = tmsrun_cli(["-c", "print(1)"], tmp_path)
    assert out.returncode == 2
    first = out.stderr.splitlines()[0]
    assert first.startswith("python -m torpor.tms.tmsrun: -c is not taken")
    assert "put the code in a file" in first
    assert tmsrun.USAGE in out.stderr


def test_sys_path_is_what_python_script_gives(tmp_path: Path) -> None:
    """The script's directory replaces -m's current directory on sys.path: a colorsys.py planted in the cwd never runs."""
    cwd = tmp_path / "shared"
    cwd.mkdir()
    (cwd / "colorsys.py").write_text("print('PLANTED')\n")
    where = tmp_path / "prog"
    where.mkdir()
    script = where / "prog.py"
    script.write_text("import colorsys, json, sys\nprint(json.dumps(sys.path))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    plain = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    out = tmsrun_cli([str(script)], cwd)
    assert out.returncode == 0, out.stderr
    assert "PLANTED" not in out.stdout
    path = [p for p in json.loads(out.stdout) if p != str(tmsrun.BOOT)]
    assert path == json.loads(plain.stdout)


@pytest.mark.parametrize("ours_first", [True, False])
def test_two_boot_directories_start_python_once(tmp_path: Path, ours_first: bool) -> None:
    """Two torpor boot directories on PYTHONPATH (a nested tmsrun of another install): Python starts, the environment's sitecustomize runs once."""
    other = tmp_path / "other" / "torpor" / "tms" / "boot"
    other.mkdir(parents=True)
    shutil.copy(tmsrun.BOOT / "sitecustomize.py", other / "sitecustomize.py")
    envsite = tmp_path / "envsite"
    envsite.mkdir()
    (envsite / "sitecustomize.py").write_text("print('ENV-SITE')\n")
    boots = [str(tmsrun.BOOT), str(other)] if ours_first else [str(other), str(tmsrun.BOOT)]
    env = {k: v for k, v in os.environ.items() if k != "TORPOR_TMS"}
    env["PYTHONPATH"] = os.pathsep.join([*boots, str(envsite), str(ROOT)])
    code = "import sys; print('RAN', type(sys.meta_path[0]).__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "TORPOR_TMS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "Error in sitecustomize" not in out.stderr, out.stderr
    assert out.stdout == "ENV-SITE\nRAN AliasFinder\n"
