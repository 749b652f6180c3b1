"""What a worker's controller is wired to when it starts: hook decisions as events, and telemetry.

When the facade starts a worker's SleepController it records the shared
predicate's decision and what it implies for custom all-reduce and NCCL as
``hook_decision`` events in that rank's log, and attaches torpor's telemetry in
multiprocess mode when a metrics directory is named: ``PROMETHEUS_MULTIPROC_DIR``
(the operator's, or vLLM's with several API servers; vLLM's ``/metrics`` then merges
every process's files) or ``TORPOR_METRICS_DIR``, which the API server's activation
sets when neither is (:func:`torpor.telemetry.multiprocess.provide_directory`), so
``vllm serve`` with no setting shows torpor's series. Telemetry is a subscriber: a
failure to attach it is logged and changes nothing else.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import TYPE_CHECKING, Any, Protocol

from torpor.hooks.allreduce import register_graph_buffers
from torpor.hooks.nccl import NCCL_GRAPH_REGISTER
from torpor.hooks.predicate import CudagraphPoolDecision
from torpor.hooks.vllm.pooldecision import decision_for
from torpor.hooks.vllm.process import current
from torpor.statemachine.core.events import EventKind
from torpor.switches import env_text

if TYPE_CHECKING:
    from torpor.statemachine.machine.controller import SleepController

logger = logging.getLogger("torpor.vllm")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
TORPOR_METRICS_ENV = (
    "TORPOR_METRICS_DIR"  # torpor.telemetry.multiprocess.TORPOR_ENV (not imported: telemetry is optional)
)


def known_decision() -> CudagraphPoolDecision | None:
    """The graph-pool decision for this process: from vLLM's current config, else the one taken at activation."""
    config_module = importlib.import_module("vllm.config") if _vllm_imported() else None
    config = config_module.get_current_vllm_config_or_none() if config_module is not None else None
    if config is not None and getattr(config, "model_config", None) is not None:
        return decision_for(config)
    state = current()
    if state is not None and state.decisions:
        return state.decisions[-1]
    return None


def _vllm_imported() -> bool:
    import sys

    return "vllm.config" in sys.modules


def record_decisions(controller: SleepController, decision: CudagraphPoolDecision | None) -> bool:
    """Append the graph-pool, all-reduce and NCCL decisions to ``controller``'s log; False when none is known yet."""
    if decision is None:
        return False
    controller.record(
        EventKind.HOOK_DECISION, hook="cudagraph_pool", active=decision.active, detail=decision.describe()
    )
    register_graph_buffers(decision, controller=controller)
    value = os.environ.get(NCCL_GRAPH_REGISTER)
    shown = "unset" if value is None else f"{value!r}"
    controller.record(
        EventKind.HOOK_DECISION,
        hook="nccl_graph_register",
        active=decision.active,
        detail=f"{NCCL_GRAPH_REGISTER} is {shown} in this worker (set before its first communicator)",
    )
    return True


def record_when_known(controller: SleepController) -> bool:
    """Record the decisions if this process knows them now (vLLM's current config, or the activation's)."""
    try:
        return record_decisions(controller, known_decision())
    except Exception:  # recording is informative; it must not stop the engine
        logger.exception("torpor: recording hook decisions failed")
        return True


def attach_telemetry(controller: SleepController) -> Any:
    """Attach torpor's telemetry when a metrics directory is named (see the module doc); the handle, or None."""
    if not (os.environ.get(MULTIPROC_ENV) or env_text(TORPOR_METRICS_ENV)):
        logger.info(
            "torpor: neither %s nor %s is set, so this worker's metrics do not reach the API server's /metrics",
            MULTIPROC_ENV,
            TORPOR_METRICS_ENV,
        )
        return None
    try:
        telemetry = importlib.import_module("torpor.telemetry")
        return telemetry.attach(controller, multiprocess=True)
    except Exception:  # telemetry is optional: the engine runs without it
        logger.exception("torpor: attaching telemetry failed; sleep and wake are unaffected")
        return None


class TelemetryHolder(Protocol):
    """What the wiring sets on the allocator facade: the telemetry handle it detaches when it closes."""

    telemetry: Any


def on_controller_started(controller: SleepController, allocator: TelemetryHolder) -> bool:
    """Called once per worker by the facade right after its controller exists; True when the decisions were recorded.

    A spawned worker knows no config when its controller starts (vLLM sets the
    current config only around later steps); the facade tries again at the
    first capture.
    """
    recorded = record_when_known(controller)
    allocator.telemetry = attach_telemetry(controller)
    return recorded
