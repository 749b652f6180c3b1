"""Custom all-reduce under the cuMem graph pool: may captured graphs IPC-register their buffers?

Custom all-reduce implementations (vLLM's, SGLang's) IPC-register the buffers
that captured graphs read, through ``cudaIpcGetMemHandle``. That call rejects
cuMem memory (``invalid argument`` at capture, and the worker exits), so when
the graph pool is active the capture must copy its input into the
pre-registered IPC buffer (ordinary ``cudaMalloc`` memory) instead, the path
eager mode uses; the cost is one device-to-device copy per captured all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torpor.hooks._record import record_decision
from torpor.hooks.predicate import CudagraphPoolDecision

if TYPE_CHECKING:
    from torpor.statemachine.machine.controller import SleepController


def register_graph_buffers(decision: CudagraphPoolDecision, *, controller: SleepController | None = None) -> bool:
    """True when graph buffers may be IPC-registered; False while the cuMem graph pool is active.

    With a ``controller`` the answer is recorded as a ``hook_decision`` event
    (hook ``custom_allreduce``).
    """
    register = not decision.active
    detail = (
        "graph buffers IPC-registered (plain graph pools)"
        if register
        else "graph buffers not registered: cudaIpcGetMemHandle rejects cuMem memory; "
        "captures copy into the pre-registered buffer"
    )
    record_decision(controller, "custom_allreduce", decision.active, detail)
    return register
