"""Build torpor's native allocator (plain C, no Python API) as torpor/allocator/native/libtorpor_alloc.so.

Beside it, torpor.tms's preload library (torpor/tms/libtorpor_torch_memory_saver_preload.so), the same way.

The metadata is in pyproject.toml. The library is loaded with ctypes, links no
libpython and no torch, and opens the CUDA driver with dlopen at run time, so
one build serves every Python 3, torch and CUDA 12/13 driver on the platform.
It needs a C compiler (gcc or clang) and nothing else: no CUDA toolkit.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tomllib

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

SOURCES = [
    "err.c",
    "hostpages.c",
    "driver_cuda.c",
    "driver_sim.c",
    "sim_host.c",
    "drv.c",
    "table.c",
    "sleep.c",
    "trim.c",
]
CSRC = os.path.join("torpor", "allocator", "native", "csrc")


class BuildNative(build_ext):
    """build_ext for a plain shared library: a fixed file name, and a clear error when there is no compiler."""

    def get_ext_filename(self, fullname: str) -> str:
        *package, name = fullname.split(".")
        return os.path.join(*package, f"{name}.so")

    def build_extension(self, ext: Extension) -> None:
        compiler = list(getattr(self.compiler, "compiler_so", None) or [os.environ.get("CC", "cc")])
        if not shutil.which(compiler[0]):
            msg = (
                f"torpor builds a small C library (its native allocator) and found no C compiler ({compiler[0]!r}). "
                "Install one and retry: Debian/Ubuntu `apt-get install gcc`, Fedora/RHEL `dnf install gcc`, "
                "Alpine `apk add gcc musl-dev`, conda `conda install -c conda-forge c-compiler`. "
                "No CUDA toolkit is needed."
            )
            raise SystemExit(msg)
        super().build_extension(ext)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # no PyInit_*: this is not a Python module


PTH = os.path.join("torpor", "tms", "torpor-tms.pth")


class BuildPyWithPth(build_py):
    """build_py that also puts torpor-tms.pth at the wheel's top (site-packages), where ``site`` runs it at start.

    The file turns torpor.tms's switch on only when TORPOR_TMS is on (1, true or on; docs/tms.md).
    """

    def run(self) -> None:
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, os.path.basename(PTH)), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, os.path.basename(PTH))]


native = Extension(
    "torpor.allocator.native.libtorpor_alloc",
    sources=[os.path.join(CSRC, s) for s in SOURCES],
    depends=[os.path.join(CSRC, h) for h in ("tp.h", "table.h", "sim.h")],
    extra_compile_args=["-std=gnu11", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"],
    libraries=["dl", "pthread"],
)

# torch_memory_saver's preload mode (torpor.tms): cudaMalloc/cudaFree onto the table above, put on LD_PRELOAD by
# torpor.tms.configure_subprocess(); its name holds "torch_memory_saver", as code looking for TMS there expects.
preload = Extension(
    "torpor.tms.libtorpor_torch_memory_saver_preload",
    sources=[os.path.join("torpor", "tms", "csrc", "tms_preload.c")],
    extra_compile_args=["-std=gnu11", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"],
    libraries=["dl", "pthread"],
)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def require_setuptools() -> None:
    """Stop with one line when this setuptools is older than pyproject's build requirement.

    pip builds in an isolated environment that has it; ``python setup.py ...`` uses whatever the running
    Python has (a fresh venv: setuptools 65.5 on Python 3.11), which fails on the SPDX license fields.
    """
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyproject.toml"), "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    for requirement in requires:
        found = re.fullmatch(r"setuptools\s*>=\s*([\d.]+)", requirement)
        if found and _version(setuptools.__version__) < _version(found.group(1)):
            msg = (
                f"torpor's pyproject.toml needs {requirement} (SPDX license metadata, PEP 639) and {sys.executable} "
                f"has setuptools {setuptools.__version__}: run `{sys.executable} -m pip install '{requirement}'` "
                "first (pip install . fetches it by itself)"
            )
            raise SystemExit(msg)


require_setuptools()
setup(ext_modules=[native, preload], cmdclass={"build_ext": BuildNative, "build_py": BuildPyWithPth})
