"""The switch: with ``TORPOR_TMS=1``, ``import torch_memory_saver`` gives :mod:`torpor.tms`, installed or not.

``TORPOR_TMS`` reads as every torpor switch (:func:`torpor.switches.env_switch`),
off when unset or empty: ``1``/``true``/``on`` turn it on, ``0``/``false``/``off``
leave it off, and anything else is said in one line on stderr at interpreter
start and leaves it off (a raise there would break every Python start).

A meta-path finder placed first on ``sys.meta_path`` answers for
``torch_memory_saver`` and the submodules TMS's users import
(``entrypoint``, ``hooks``, ``hooks.mode_preload``, ``testing_utils``) with
torpor's modules, so the real package, if installed, is never loaded. The
``torpor-tms.pth`` file that installing torpor puts in site-packages calls
:func:`activate` at every interpreter start where ``TORPOR_TMS`` is set, which installs the finder only
when it is on; spawned children inherit the variable and run the same
``.pth``. Without it nothing changes. ``python -m torpor.tms.tmsrun`` does the
same where the ``.pth`` is not installed (docs/tms.md, "The switch").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence
from types import ModuleType

from torpor.errors import TmsNotProvided
from torpor.switches import env_switch

logger = logging.getLogger("torpor.tms")

ENV = "TORPOR_TMS"
NCCL_GRAPH_REGISTER = "NCCL_GRAPH_REGISTER"  # torpor.hooks.nccl's, not imported: the .pth stays light
TMS = "torch_memory_saver"

#: What each TMS module name gives under the switch.
ALIASES: dict[str, str] = {
    TMS: "torpor.tms",
    f"{TMS}.entrypoint": "torpor.tms.saver",
    f"{TMS}.hooks": "torpor.tms",
    f"{TMS}.hooks.mode_preload": "torpor.tms.preload",
    f"{TMS}.testing_utils": "torpor.tms.testingutils",
    f"{TMS}.utils": "torpor.tms.utils",
}

_said = False


def active() -> str:
    """Which implementation ``import torch_memory_saver`` gives in this process, in words."""
    if any(isinstance(f, AliasFinder) for f in sys.meta_path):
        return f"import {TMS} gives torpor.tms ({ENV} is on): torpor's implementation of {TMS} 0.0.10's API"
    return f"torpor.tms, imported by name ({ENV} is off: import {TMS} gives the installed package)"


class _AliasLoader(importlib.abc.Loader):
    """Hands out an already imported torpor module under the TMS name."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        global _said  # noqa: PLW0603 -- said once per process
        module = importlib.import_module(self.target)
        if not _said:
            _said = True
            logger.info("torpor.tms: %s", active())
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the torpor module is imported already."""


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch_memory_saver`` (and the submodules of :data:`ALIASES`) as torpor's modules."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for a TMS name torpor answers; None for any other name (the next finder looks)."""
        aliased = ALIASES.get(fullname)
        if aliased is None:
            if fullname.startswith(f"{TMS}."):
                msg = f"torpor.tms does not provide {fullname!r} ({ENV}=1; docs/tms.md lists what it provides)"
                raise TmsNotProvided(msg, name=fullname)
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(aliased), is_package=aliased == "torpor.tms")


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once); a ``torch_memory_saver`` imported before is replaced."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
    for name in [n for n in sys.modules if n == TMS or n.startswith(f"{TMS}.")]:
        del sys.modules[name]


def nccl_default(environ: MutableMapping[str, str]) -> None:
    """``NCCL_GRAPH_REGISTER=0`` where it is unset: graphs captured through ``cuda_graph()`` live in torpor's pool.

    NCCL reads the variable once, at the first communicator, which an engine
    builds before its first ``torch_memory_saver`` call, so the switch sets it at
    start (torpor.hooks.nccl says why registration must be off: TMS #88).
    """
    if not environ.get(NCCL_GRAPH_REGISTER, "").strip():
        environ[NCCL_GRAPH_REGISTER] = "0"


def activate(environ: MutableMapping[str, str] | None = None) -> bool:
    """Install the finder when the switch ``TORPOR_TMS`` is on (what the ``.pth`` calls at start); True when it did.

    A value that is no switch leaves it off, said in one line on stderr (not
    raised: this runs as every Python process starts, its children's too).
    """
    env = os.environ if environ is None else environ
    try:
        on = env_switch(ENV, env, default=False)
    except ValueError as exc:
        print(f"torpor.tms: {exc}; the {TMS} switch stays off", file=sys.stderr)  # noqa: T201 -- no logging at start
        return False
    if not on:
        return False
    nccl_default(env)
    install()
    return True
