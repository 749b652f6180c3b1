"""The ``torpor bench`` harness: torpor, a vLLM-style baseline and torch_memory_saver side by side, against the host-link floor.

Runs on a CUDA machine (``torpor bench``). For each workload and system it
records first and later sleep, wake, device bytes released, pinned host bytes
held, bit-exactness, and each time as a ratio to the floor measured in the same
run (bytes over the measured pinned-copy bandwidth).

It lives outside :mod:`torpor.allocator` because it drives the allocator
through the controller, and the mechanism never imports the controller:

- :mod:`~torpor.bench.result`: one result and its table row;
- :mod:`~torpor.bench.device`: raw ranges as tensors, the pinned-copy floor;
- :mod:`~torpor.bench.systems`: the systems compared on one workload;
- :mod:`~torpor.bench.host`: the host-memory modes and pageable copies;
- :mod:`~torpor.bench.interference`: awake step times while pinning ahead;
- :mod:`~torpor.bench.harness`: the whole run;
- :mod:`~torpor.bench.report`: progress lines and the Markdown tables;
- :mod:`~torpor.bench.realmodel`, :mod:`~torpor.bench.tmsbackends`: the real-model rows
  (``torpor bench --real-model``), torch_memory_saver's API on its pinned, mmap and disk backups;
- :mod:`~torpor.bench.vllm`, :mod:`~torpor.bench.vllm_engine`: vLLM's ``cumem`` against torpor
  (``torpor bench --vllm``), each row against the floor of :mod:`~torpor.bench.linkfloor`.
"""

from __future__ import annotations

from torpor.bench.device import measure_floor
from torpor.bench.harness import run
from torpor.bench.host import HOST_MODES, host_markdown, measure_pageable
from torpor.bench.interference import engine_step, measure_pinning_interference
from torpor.bench.report import markdown
from torpor.bench.result import Result
from torpor.bench.systems import VllmStyle, run_baseline_raw, run_tms_raw, run_torpor_graphs, run_torpor_raw

__all__ = [
    "HOST_MODES",
    "Result",
    "VllmStyle",
    "engine_step",
    "host_markdown",
    "markdown",
    "measure_floor",
    "measure_pageable",
    "measure_pinning_interference",
    "run",
    "run_baseline_raw",
    "run_tms_raw",
    "run_torpor_graphs",
    "run_torpor_raw",
]
