"""torpor.tms: torch_memory_saver's public API (0.0.10) on torpor's allocator and state machine.

``from torpor.tms import torch_memory_saver`` gives what ``from
torch_memory_saver import torch_memory_saver`` gives, and with ``TORPOR_TMS=1``
an unmodified ``import torch_memory_saver`` gives this package
(:mod:`torpor.tms.switch`). Each TMS tag is one torpor engine whose pause and
resume are a logged sleep and wake with metrics (docs/tms.md).

The names load on first use (as ``torpor``'s own): the ``.pth`` that turns the
switch on in every Python process imports only :mod:`torpor.tms.switch`, not
the allocator, the controller or telemetry.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torpor.errors import TagStateError, TmsConfigError, TmsError, TmsUsageError
    from torpor.tms.preload import configure_subprocess
    from torpor.tms.saver import TorchMemorySaver

    #: The process's saver, as TMS's global singleton.
    torch_memory_saver: TorchMemorySaver

__all__ = [
    "TagStateError",
    "TmsConfigError",
    "TmsError",
    "TmsUsageError",
    "TorchMemorySaver",
    "configure_subprocess",
    "torch_memory_saver",
]

_LAZY = {
    "TorchMemorySaver": "torpor.tms.saver",
    "configure_subprocess": "torpor.tms.preload",
    "TagStateError": "torpor.errors",
    "TmsConfigError": "torpor.errors",
    "TmsError": "torpor.errors",
    "TmsUsageError": "torpor.errors",
}
_SINGLETON = "torch_memory_saver"
_C_ENTRY_POINTS = "torpor.tms.binarywrapper"  # loaded only with the preload library on LD_PRELOAD
_lock = threading.RLock()  # re-entrant: loading a name may load another


def __getattr__(name: str) -> object:
    with _lock:  # the singleton is made once, whichever thread asks first
        if name in globals():
            return globals()[name]
        if name == _SINGLETON:
            value: object = _make_singleton()
        else:
            module = _LAZY.get(name)
            if module is None:
                msg = f"module 'torpor.tms' has no attribute {name!r}"
                raise AttributeError(msg)
            value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def _make_singleton() -> object:
    saver_class = __getattr__("TorchMemorySaver")
    return saver_class()  # type: ignore[operator]


def _register_c_entry_points() -> None:
    """With torpor's preload library on LD_PRELOAD, C callers of ``tms_pause``/``tms_resume`` reach the saver from now on."""
    if "libtorpor_torch_memory_saver_preload" in os.environ.get("LD_PRELOAD", ""):
        binarywrapper = importlib.import_module(_C_ENTRY_POINTS)
        binarywrapper.register_default(lambda: __getattr__(_SINGLETON))


_register_c_entry_points()
