"""torpor.tms: torch_memory_saver's public API (0.0.10) on torpor's allocator and state machine.

``from torpor.tms import torch_memory_saver`` gives what ``from
torch_memory_saver import torch_memory_saver`` gives, and with ``TORPOR_TMS=1``
an unmodified ``import torch_memory_saver`` gives this package
(:mod:`torpor.tms.switch`). Each TMS tag is one torpor engine whose pause and
resume are a logged sleep and wake with metrics (docs/tms.md).
"""

from __future__ import annotations

from torpor.tms.preload import configure_subprocess
from torpor.tms.saver import TorchMemorySaver
from torpor.tms.tmserrors import TagStateError, TmsConfigError, TmsError, TmsUsageError

#: The process's saver, as TMS's global singleton.
torch_memory_saver = TorchMemorySaver()

__all__ = [
    "TagStateError",
    "TmsConfigError",
    "TmsError",
    "TmsUsageError",
    "TorchMemorySaver",
    "configure_subprocess",
    "torch_memory_saver",
]
