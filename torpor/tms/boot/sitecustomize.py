"""Put on ``PYTHONPATH`` by ``python -m torpor.tms.tmsrun``: every Python child starts with the switch on.

Imported by ``site`` as ``sitecustomize`` at interpreter start; activates the
switch (``TORPOR_TMS=1`` is set by the runner), then runs the
``sitecustomize`` it shadows, if the environment has one. Every torpor boot
directory on the path is skipped in that search, this install's and another's
(a ``tmsrun`` nested in another torpor's): each would find the other's and run
it, for ever.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from torpor.tms.switch import activate

activate()

#: The tail of a boot directory's path in any torpor install (this file's own directory).
_BOOT_TAIL = ("torpor", "tms", "boot")


def _is_boot(entry: str) -> bool:
    """Whether a ``sys.path`` entry is a torpor boot directory (whichever install it belongs to)."""
    parts = os.path.normcase(os.path.abspath(entry or ".")).split(os.sep)
    return tuple(parts[-len(_BOOT_TAIL) :]) == _BOOT_TAIL


_rest = [p for p in sys.path if not _is_boot(p)]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:  # the environment's own sitecustomize, which this one shadows
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
