"""NCCL's default under the cuMem graph pool: graph registration off (``NCCL_GRAPH_REGISTER=0``).

With graph registration on, NCCL registers the user buffers that captured
graphs read and keeps their cuMem handles: that pins memory through sleep, and
after a wake maps new physical pages at the same addresses NCCL still holds the
old registrations, so replays can hang or give wrong results
(fzyzcjy/torch_memory_saver#88, sgl-project/sglang#40648). NCCL reads the
variable once per process, when the first communicator is built, so the default
has to be applied before that (workers inherit the environment). With the pool
inactive the environment is left exactly as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torpor.hooks._record import record_decision
from torpor.hooks._warn import warn_once
from torpor.hooks.predicate import CudagraphPoolDecision

if TYPE_CHECKING:
    from torpor.statemachine.machine.controller import SleepController

NCCL_GRAPH_REGISTER = "NCCL_GRAPH_REGISTER"

#: Why an explicit non-zero value is dangerous with the cuMem graph pool.
DANGER = (
    "graph-registered buffers keep the old physical pages across sleep: after a wake remaps new memory "
    "at the same addresses NCCL still holds stale registrations, and replayed collectives can hang or give "
    "wrong results (fzyzcjy/torch_memory_saver#88, sgl-project/sglang#40648)"
)


@dataclass(frozen=True)
class NcclDecision:
    """What :func:`apply_nccl_defaults` did.

    ``action`` is ``set`` (the default was written), ``kept`` (an explicit
    value was left in place) or ``untouched`` (pool inactive); ``value`` is
    the variable's value afterwards (None: unset); ``safe`` is False when the
    pool is active and graph registration stays on.
    """

    active: bool
    action: str
    value: str | None
    safe: bool
    detail: str


def _distributed_initialized() -> bool:
    """True when torch.distributed was already initialized (without importing torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False
    try:
        return bool(dist.is_available() and dist.is_initialized())
    except Exception:  # a half-imported torch must not break startup
        return False


def apply_nccl_defaults(
    decision: CudagraphPoolDecision,
    environ: MutableMapping[str, str] = os.environ,
    *,
    controller: SleepController | None = None,
) -> NcclDecision:
    """Set ``NCCL_GRAPH_REGISTER=0`` when the graph pool is active and the variable is unset.

    An explicit value is kept; a value other than ``0`` is warned about once
    per process, saying why it is dangerous. Inactive: ``environ`` is not
    touched. Call it before the first NCCL communicator exists. With a
    ``controller`` the outcome is recorded as a ``hook_decision`` event (hook
    ``nccl_graph_register``).
    """
    current = environ.get(NCCL_GRAPH_REGISTER)
    explicit = current is not None and current.strip() != ""
    if not decision.active:
        shown = f"{current!r}" if current is not None else "unset"
        result = NcclDecision(
            False, "untouched", current, True, f"cuMem graph pool inactive: {NCCL_GRAPH_REGISTER} left {shown}"
        )
    elif not explicit:
        environ[NCCL_GRAPH_REGISTER] = "0"
        detail = f"cuMem graph pool active: set {NCCL_GRAPH_REGISTER}=0 (was unset)"
        if _distributed_initialized():
            late = (
                f"{NCCL_GRAPH_REGISTER}=0 was set after torch.distributed was initialized: NCCL reads it once per "
                "process, so communicators built already keep graph registration on; apply the hooks' NCCL "
                "defaults before the first communicator"
            )
            warn_once("nccl:late", late)
            detail += "; late: torch.distributed was already initialized"
        result = NcclDecision(True, "set", "0", True, detail)
    elif current is not None and current.strip() == "0":
        result = NcclDecision(
            True, "kept", current, True, f"cuMem graph pool active: kept explicit {NCCL_GRAPH_REGISTER}=0"
        )
    else:
        warn_once(
            f"nccl:{current}",
            f"{NCCL_GRAPH_REGISTER}={current} is set explicitly and kept, but the cuMem graph pool is active and "
            f"this is dangerous: {DANGER}. Unset it (torpor then sets 0) or set {NCCL_GRAPH_REGISTER}=0.",
        )
        result = NcclDecision(
            True,
            "kept",
            current,
            False,
            f"cuMem graph pool active: kept explicit {NCCL_GRAPH_REGISTER}={current} (dangerous: stale registrations after wake)",
        )
    record_decision(controller, "nccl_graph_register", result.active, result.detail)
    return result
