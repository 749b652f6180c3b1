"""The switch: TORPOR_TMS=1 makes an unmodified `import torch_memory_saver` give torpor.tms, in children too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from torpor.tms import switch

ROOT = Path(__file__).resolve().parent.parent
PTH = ROOT / "torpor" / "tms" / "torpor-tms.pth"
WHEEL = ROOT / ".whl" / "torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl"

PROBE = (
    "import torch_memory_saver as t\n"
    "from torch_memory_saver import torch_memory_saver, TorchMemorySaver, configure_subprocess\n"
    "from torch_memory_saver.hooks.mode_preload import configure_subprocess as c2\n"
    "print('IMPL', t.__name__, type(torch_memory_saver).__module__, c2 is configure_subprocess)\n"
)


def site_dir(tmp_path: Path) -> Path:
    """A directory holding torpor's .pth, as installing torpor leaves site-packages."""
    d = tmp_path / "site"
    d.mkdir(exist_ok=True)
    shutil.copy(PTH, d / PTH.name)
    return d


def run(code: str, env_extra: dict[str, str], tmp_path: Path, argv: list[str] | None = None) -> str:
    """Run ``code`` in a fresh interpreter whose site dirs include the .pth's; its stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORPOR_TMS", "PYTHONPATH")}
    env.update(env_extra)
    boot = f"import site; site.addsitedir({str(site_dir(tmp_path))!r})\n"
    cmd = argv if argv is not None else [sys.executable, "-c", boot + code]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout + out.stderr


def real_tms(tmp_path: Path) -> str | None:
    """A directory with the real torch_memory_saver 0.0.10's Python part (None when the wheel is not here)."""
    if not WHEEL.is_file():
        return None
    target = tmp_path / "real"
    with zipfile.ZipFile(WHEEL) as whl:
        whl.extractall(target)
    return str(target)


def test_the_pth_turns_the_switch_on(tmp_path: Path) -> None:
    """With TORPOR_TMS=1 the .pth makes torch_memory_saver torpor.tms, and its submodules torpor's."""
    out = run(PROBE, {"TORPOR_TMS": "1"}, tmp_path)
    assert "IMPL torpor.tms torpor.tms.saver True" in out


def test_the_switch_wins_over_the_real_package(tmp_path: Path) -> None:
    """The real TMS on the path is never loaded under the switch; without it, the real one is."""
    real = real_tms(tmp_path)
    if real is None:
        pytest.skip("the real torch_memory_saver wheel is not in .whl/")
    pytest.importorskip("torch")
    out = run(PROBE, {"TORPOR_TMS": "1", "PYTHONPATH": real}, tmp_path)
    assert "IMPL torpor.tms torpor.tms.saver True" in out
    plain = run(
        "import torch_memory_saver as t; print('IMPL', t.__file__)", {"PYTHONPATH": real, "TORPOR_TMS": "0"}, tmp_path
    )
    assert f"IMPL {real}" in plain


def test_without_the_switch_nothing_changes(tmp_path: Path) -> None:
    """Without TORPOR_TMS=1 (and no TMS installed) import torch_memory_saver fails as before."""
    code = (
        "import importlib.util, sys\n"
        "print('FOUND', importlib.util.find_spec('torch_memory_saver') is not None and 'real' not in str(sys.path))\n"
        "from torpor.tms.switch import AliasFinder\n"
        "print('FINDER', any(isinstance(f, AliasFinder) for f in sys.meta_path))\n"
    )
    out = run(code, {}, tmp_path)
    assert "FINDER False" in out


def test_children_inherit_the_switch(tmp_path: Path) -> None:
    """A program started by `python -m torpor.tms.tmsrun` and the Python processes it spawns get torpor's TMS."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import multiprocessing as mp, subprocess, sys\n"
        "import torch_memory_saver\n"
        "print('PARENT', torch_memory_saver.__name__)\n"
        "def child(q):\n"
        "    import torch_memory_saver as t\n"
        "    q.put(t.__name__)\n"
        "if __name__ == '__main__':\n"
        "    code = 'import torch_memory_saver as t; print(\"GRANDCHILD\", t.__name__)'\n"
        "    subprocess.run([sys.executable, '-c', code], check=True)\n"
        "    ctx = mp.get_context('spawn'); q = ctx.Queue(); p = ctx.Process(target=child, args=(q,))\n"
        "    p.start(); print('SPAWNED', q.get(timeout=60)); p.join()\n"
    )
    out = run("", {}, tmp_path, argv=[sys.executable, "-m", "torpor.tms.tmsrun", str(script)])
    for who in ("PARENT", "GRANDCHILD", "SPAWNED"):
        assert f"{who} torpor.tms" in out


def test_the_log_says_once_which_implementation(tmp_path: Path) -> None:
    """torpor's log says once, at the first import, which implementation is active."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import torch_memory_saver\nimport torch_memory_saver.entrypoint\n"
    )
    out = run(code, {"TORPOR_TMS": "1"}, tmp_path)
    assert out.count("torpor.tms: import torch_memory_saver") == 1
    assert "torpor's implementation" in out


def test_an_unknown_submodule_is_named(tmp_path: Path) -> None:
    """A TMS submodule torpor does not provide fails with a message that says so."""
    code = "try:\n    import torch_memory_saver.binary_wrapper\nexcept ModuleNotFoundError as e:\n    print('ERR', e)\n"
    out = run(code, {"TORPOR_TMS": "1"}, tmp_path)
    assert "ERR torpor.tms does not provide 'torch_memory_saver.binary_wrapper'" in out


def test_the_switch_turns_nccl_graph_registration_off() -> None:
    """Under the switch NCCL_GRAPH_REGISTER defaults to 0 (TMS #88); an explicit value is kept."""
    env: dict[str, str] = {}
    switch.nccl_default(env)
    assert env == {"NCCL_GRAPH_REGISTER": "0"}
    kept = {"NCCL_GRAPH_REGISTER": "1"}
    switch.nccl_default(kept)
    assert kept == {"NCCL_GRAPH_REGISTER": "1"}


def test_activate_reads_the_variable() -> None:
    """activate() installs nothing unless TORPOR_TMS is 1."""
    assert switch.activate({}) is False
    assert switch.activate({"TORPOR_TMS": "0"}) is False
    assert "imported by name" in switch.active()


def test_sglangs_adapter_calls_work_under_the_switch(tmp_path: Path) -> None:
    """The calls SGLang's adapter makes through the module (singleton, configure_subprocess, region, pause, resume)."""
    code = (
        "import torch_memory_saver\n"
        "from torpor.allocator import SimDriver, TaggedAllocator\n"
        "saver = torch_memory_saver.torch_memory_saver\n"
        "alloc = TaggedAllocator(SimDriver(64 << 20))\n"
        "saver.bind(alloc, telemetry=False)\n"
        "with torch_memory_saver.configure_subprocess():\n"
        "    pass\n"
        "for tag, cpu in (('weights', True), ('kv_cache', False), ('cuda_graph', False)):\n"
        "    with saver.region(tag=tag, enable_cpu_backup=cpu):\n"
        "        alloc.allocate(2 << 20)\n"
        "assert saver.enabled\n"
        "for tag in ('kv_cache', 'weights', 'cuda_graph'):\n"
        "    saver.pause(tag=tag)\n"
        "for tag in ('cuda_graph', 'weights', 'kv_cache'):\n"
        "    saver.resume(tag=tag)\n"
        "print('STATES', sorted((t, c.state.value) for t, c in saver._impl.controllers.items()))\n"
    )
    out = run(code, {"TORPOR_TMS": "1"}, tmp_path)
    assert "STATES [('cuda_graph', 'awake'), ('kv_cache', 'awake'), ('weights', 'awake')]" in out


@pytest.mark.parametrize("value", ["true", "on", "TRUE", " 1 "])
def test_every_on_word_turns_the_switch_on(tmp_path: Path, value: str) -> None:
    """TORPOR_TMS=true, on, TRUE read as every torpor switch: on, at interpreter start through the .pth."""
    out = run(PROBE, {"TORPOR_TMS": value}, tmp_path)
    assert "IMPL torpor.tms torpor.tms.saver True" in out


@pytest.mark.parametrize("value", ["yes", "2", "bogus"])
def test_a_switch_typo_is_said_in_one_line_and_python_still_starts(tmp_path: Path, value: str) -> None:
    """TORPOR_TMS=yes, 2 or bogus: one stderr line naming the variable, the switch off, the program runs (exit 0)."""
    code = "from torpor.tms.switch import AliasFinder; import sys\nprint('RAN', any(isinstance(f, AliasFinder) for f in sys.meta_path))\n"
    env = {k: v for k, v in os.environ.items() if k not in ("TORPOR_TMS", "PYTHONPATH")}
    boot = f"import site; site.addsitedir({str(site_dir(tmp_path))!r})\n"
    out = subprocess.run(
        [sys.executable, "-c", boot + code],
        env={**env, "TORPOR_TMS": value},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "RAN False\n"
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"torpor.tms: TORPOR_TMS={value!r} is not a switch (use 1 or 0)"), out.stderr
    assert "stays off" in lines[0]


def test_the_log_line_is_one_sentence(tmp_path: Path) -> None:
    """The switch's log line says what import torch_memory_saver gives, once, without repeating itself."""
    code = "import logging; logging.basicConfig(level=logging.INFO, format='%(message)s')\nimport torch_memory_saver\n"
    out = run(code, {"TORPOR_TMS": "1"}, tmp_path)
    said = [line for line in out.splitlines() if "import torch_memory_saver" in line]
    assert said == [
        "torpor.tms: import torch_memory_saver gives torpor.tms (TORPOR_TMS is on): "
        "torpor's implementation of torch_memory_saver 0.0.10's API"
    ]
