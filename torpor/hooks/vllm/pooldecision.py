"""vLLM's graph-pool predicate extended to the ``torpor`` backend, fed from a ``VllmConfig``.

vLLM 0.33 has one predicate, ``VllmConfig.use_cumem_cudagraph_pool``, read by
capture routing (``vllm/compilation/cudagraph_pool.py:capture_pool``), by
``CudaCommunicator`` (custom all-reduce graph-buffer registration) and by
``VllmConfig.__post_init__`` (the ``NCCL_GRAPH_REGISTER=0`` default). It requires
``sleep_mode_backend == "cumem"``. For a config selecting ``torpor`` the
extension answers with torpor's shared predicate
(:func:`torpor.hooks.cudagraph_pool_decision`); for every other config it
answers exactly what vLLM's own property answers.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from torpor.hooks.predicate import CudagraphPoolDecision, cudagraph_pool_decision

#: The backend name torpor registers with vLLM's ``SleepModeBackendFactory``.
BACKEND = "torpor"

_lock = threading.Lock()
_decisions: dict[tuple[bool, bool, str | None, bool, str], CudagraphPoolDecision] = {}


def vllm_platform() -> str:
    """``cuda``, ``rocm`` or vLLM's device type for other platforms, from ``vllm.platforms.current_platform``."""
    platform = importlib.import_module("vllm.platforms").current_platform
    if platform.is_rocm():
        return "rocm"
    if platform.is_cuda():
        return "cuda"
    return str(platform.device_type or type(platform).__name__)


def cudagraphs_on(vllm_config: Any) -> bool:
    """True unless the config's ``compilation_config.cudagraph_mode`` is ``NONE`` (eager)."""
    mode = vllm_config.compilation_config.cudagraph_mode
    none = importlib.import_module("vllm.config").CUDAGraphMode.NONE
    return bool(mode != none)


def selects_torpor(model_config: Any) -> bool:
    """True when a ``ModelConfig`` (or ``EngineArgs``) selects sleep mode with backend ``torpor``."""
    return (
        model_config is not None
        and bool(getattr(model_config, "enable_sleep_mode", False))
        and getattr(model_config, "sleep_mode_backend", None) == BACKEND  # exact, as vLLM's factory looks it up
    )


def decision_for(vllm_config: Any, platform: str | None = None) -> CudagraphPoolDecision:
    """torpor's shared predicate for one ``VllmConfig``: the option, sleep mode, backend, graphs, platform.

    Decisions are kept per set of inputs, so the one warning the predicate
    gives for an opted-in but inactive pool comes once, not at every capture.
    """
    model_config = vllm_config.model_config
    key = (
        bool(getattr(model_config, "sleep_mode_offload_cudagraph", False)),
        bool(getattr(model_config, "enable_sleep_mode", False)),
        getattr(model_config, "sleep_mode_backend", None),
        cudagraphs_on(vllm_config),
        platform if platform is not None else vllm_platform(),
    )
    with _lock:
        cached = _decisions.get(key)
    if cached is not None:
        return cached
    decision = cudagraph_pool_decision(*key)
    with _lock:
        _decisions[key] = decision
    return decision


def forget_decisions() -> None:
    """Drop the kept decisions (tests, or a process that reconfigures its platform)."""
    with _lock:
        _decisions.clear()


def extended_predicate(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """The getter installed as ``VllmConfig.use_cumem_cudagraph_pool`` while torpor is active.

    ``torpor`` configs get torpor's decision; any other config gets
    ``original(config)``, vLLM's own getter, unchanged.
    """

    def use_cumem_cudagraph_pool(self: Any) -> bool:
        """Whether CUDA graphs go to the cuMem pool that sleep offloads (vLLM's, extended to ``torpor``)."""
        if selects_torpor(self.model_config):
            return decision_for(self).active
        return original(self)

    use_cumem_cudagraph_pool.__torpor_original__ = original  # type: ignore[attr-defined]
    return use_cumem_cudagraph_pool
