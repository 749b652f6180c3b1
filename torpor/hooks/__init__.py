"""Hooks: the shared cuMem graph-pool predicate, capture routing, NCCL and all-reduce settings, RL feeds.

Everything here reads decisions or events and changes nothing in the
controller or the allocator: the predicate and the settings derived from it
are pure functions (recorded as ``hook_decision`` events when a controller is
given), capture routing goes through ``SleepController.capture``, and the RL
feeds read the per-rank event logs. The vLLM plugin lives in
``torpor.hooks.vllm`` and is imported only by vLLM's plugin loader, never from
here, so this package works without vLLM installed.
"""

from __future__ import annotations

from torpor.errors import CaptureRoutingError
from torpor.hooks._warn import reset_warnings
from torpor.hooks.allreduce import register_graph_buffers
from torpor.hooks.capture import (
    GraphPoolHooks,
    NcclGraphPoolHook,
    add_graph_pool_hook,
    capture_pool,
    in_plain_capture,
    nccl_graph_pool_hook,
    plain_capture,
    remove_graph_pool_hook,
    routes_to_cumem,
    set_nccl_graph_pool_hook,
)
from torpor.hooks.nccl import NCCL_GRAPH_REGISTER, NcclDecision, apply_nccl_defaults
from torpor.hooks.predicate import (
    CUMEM_BACKENDS,
    REQUIREMENTS,
    CudagraphPoolDecision,
    cudagraph_pool_decision,
    detect_platform,
)
from torpor.readmodel import (
    ENGINE_STATES,
    EngineView,
    FleetError,
    FleetView,
    GroupView,
    RankView,
    fleet,
    rank_logs,
    wait_fleet,
    wait_fleet_async,
)
from torpor.statemachine.log.follow import Follower, follow, follow_async

__all__ = [
    "CUMEM_BACKENDS",
    "ENGINE_STATES",
    "NCCL_GRAPH_REGISTER",
    "REQUIREMENTS",
    "CaptureRoutingError",
    "CudagraphPoolDecision",
    "EngineView",
    "FleetError",
    "FleetView",
    "Follower",
    "GraphPoolHooks",
    "GroupView",
    "NcclDecision",
    "NcclGraphPoolHook",
    "RankView",
    "add_graph_pool_hook",
    "apply_nccl_defaults",
    "capture_pool",
    "cudagraph_pool_decision",
    "detect_platform",
    "fleet",
    "follow",
    "follow_async",
    "in_plain_capture",
    "nccl_graph_pool_hook",
    "plain_capture",
    "rank_logs",
    "register_graph_buffers",
    "remove_graph_pool_hook",
    "reset_warnings",
    "routes_to_cumem",
    "set_nccl_graph_pool_hook",
    "wait_fleet",
    "wait_fleet_async",
]
