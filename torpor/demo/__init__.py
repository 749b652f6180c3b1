"""torpor demo: the whole product on one screen, on a GPU or on the simulated device.

:func:`run_demo` picks the device (CUDA when available, else
``torpor.allocator.SimDriver``), builds a model-like workload with memory under
the tags ``weights``, ``kv_cache``, ``cudagraph`` and ``runtime``, and runs
sleep/wake cycles through a :class:`~torpor.SleepController`, checking every
wake bit-exact, while it serves metrics and writes the event log.
"""

from __future__ import annotations

from torpor.demo.cycles import CYCLE_KINDS, CycleKind, CycleResult, run_cycle
from torpor.demo.run import DEVICES, DemoOptions, pick_device, run_demo
from torpor.demo.workload import BATCH_SIZES, DEMO_TAGS, Check, Workload
from torpor.errors import DemoError

__all__ = [
    "BATCH_SIZES",
    "CYCLE_KINDS",
    "DEMO_TAGS",
    "DEVICES",
    "Check",
    "CycleKind",
    "CycleResult",
    "DemoError",
    "DemoOptions",
    "Workload",
    "pick_device",
    "run_cycle",
    "run_demo",
]
