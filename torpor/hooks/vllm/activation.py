"""The vLLM plugin's entry point and the only changes it makes to vLLM: what, when, and how to undo them.

vLLM loads ``vllm.general_plugins`` entry points with no arguments, often once
in the API server before any config exists, and forks the engine core and the
workers from there by default. So the plugin cannot see at load time whether
torpor is selected. It does two things at load, in every process:

1. registers the sleep backend ``torpor`` with ``SleepModeBackendFactory``
   (vLLM's documented extension point; nothing is imported until selected);
2. wraps ``VllmConfig.__post_init__`` in a probe. For a config that does not
   select ``torpor`` the probe calls vLLM's ``__post_init__`` unchanged and
   does nothing else: vLLM behaves exactly as without the plugin.

Only when a config selecting ``torpor`` is built (or ``TORPOR_VLLM_ACTIVE=1``
is set: spawned workers inherit it) does :func:`activate` make the two
changes that route vLLM through torpor, both process-wide and undone by
:func:`deactivate`:

- ``VllmConfig.use_cumem_cudagraph_pool`` becomes a property that answers
  torpor's shared predicate for ``torpor`` configs and vLLM's original answer
  for every other config (capture routing, ``CudaCommunicator`` and the NCCL
  default read it);
- the ``CuMemAllocator.instance`` singleton slot holds torpor's allocator
  facade, so ``get_mem_allocator_instance()`` returns it (no function of
  vLLM is replaced).

vLLM modules are imported through ``importlib`` so that ``import torpor`` never
imports vLLM and the type checker does not walk vLLM's sources.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

from torpor.errors import (
    ActivationError,
)
from torpor.hooks.nccl import NCCL_GRAPH_REGISTER, apply_nccl_defaults
from torpor.hooks.vllm.facade import get_instance
from torpor.hooks.vllm.pooldecision import BACKEND, decision_for, extended_predicate, selects_torpor
from torpor.hooks.vllm.process import ENV_ACTIVE, Activation, _lock, _process
from torpor.hooks.vllm.settings import DEFAULT_ENGINE, ENV_ENGINE
from torpor.switches import env_switch, env_text

logger = logging.getLogger("torpor.vllm")

#: ``0`` leaves ``VllmConfig`` untouched at load (no probe); torpor then activates only with ``TORPOR_VLLM_ACTIVE=1``.
ENV_PROBE = "TORPOR_VLLM_PROBE"
#: Set: load format ``torpor-keeper`` is registered (``torpor.hooks.vllm.keeperloader.ENV_ENGINE``).
ENV_KEEPER_ENGINE = "TORPOR_KEEPER_ENGINE"
BACKEND_MODULE = "torpor.hooks.vllm.backend"
BACKEND_CLASS = "TorporSleepBackend"


def _vllm_config_class() -> Any:
    return importlib.import_module("vllm.config").VllmConfig


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the backend, install the probe, activate if told to."""
    register_backend()
    if env_text(ENV_KEEPER_ENGINE):  # the keeper's load format (docs/keeper.md); loads the allocator
        importlib.import_module("torpor.hooks.vllm.keeperloader").register()
    if env_switch(ENV_PROBE):
        install_probe()
    if env_switch(ENV_ACTIVE, default=False):
        activate()


def register_backend() -> None:
    """Register sleep backend ``torpor`` with vLLM's ``SleepModeBackendFactory`` (once per process)."""
    factory = importlib.import_module("vllm.device_allocator.sleep_mode_backend").SleepModeBackendFactory
    try:
        factory.register_backend(BACKEND, BACKEND_MODULE, BACKEND_CLASS)
    except ValueError:
        logger.debug("torpor: sleep backend %r is registered already", BACKEND)


def install_probe() -> None:
    """Wrap ``VllmConfig.__post_init__`` so a config selecting torpor activates it; others pass through."""
    cls = _vllm_config_class()
    with _lock:
        current = cls.__dict__["__post_init__"]
        if getattr(current, "__torpor_probe__", False):
            return
        original: Callable[..., Any] = current

        def __post_init__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not selects_torpor(getattr(self, "model_config", None)):
                return original(self, *args, **kwargs)
            return _post_init_selected(self, original, args, kwargs)

        __post_init__.__torpor_probe__ = True  # type: ignore[attr-defined]
        __post_init__.__wrapped__ = original  # type: ignore[attr-defined]
        __post_init__.__doc__ = original.__doc__
        _process.probe_original = original
        cls.__post_init__ = __post_init__


def remove_probe() -> None:
    """Put vLLM's own ``VllmConfig.__post_init__`` back."""
    with _lock:
        if _process.probe_original is not None:
            _vllm_config_class().__post_init__ = _process.probe_original
            _process.probe_original = None


def _post_init_selected(config: Any, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """A config selecting torpor: activate, run vLLM's ``__post_init__``, then apply torpor's NCCL default."""
    before = os.environ.get(NCCL_GRAPH_REGISTER)
    state = activate()
    result = original(config, *args, **kwargs)
    decision = decision_for(config)
    # vLLM's own __post_init__ applied its default through the extended predicate already; torpor decides
    # from the environment as the user left it, and the outcome is the same value (0 when active and unset).
    scratch = {} if before is None else {NCCL_GRAPH_REGISTER: before}
    nccl = apply_nccl_defaults(decision, scratch)
    if nccl.value is not None:
        os.environ[NCCL_GRAPH_REGISTER] = nccl.value
    with _lock:
        state.decisions.append(decision)
        state.nccl.append(nccl)
    logger.info("torpor: sleep backend 'torpor' selected; %s; NCCL: %s", decision.describe(), nccl.detail)
    return result


def activate() -> Activation:
    """Route this process's vLLM through torpor (idempotent); see the module docstring for what changes."""
    with _lock:
        if _process.active is not None:
            return _process.active
        cls = _vllm_config_class()
        original = cls.__dict__["use_cumem_cudagraph_pool"]
        allocator = get_instance()
        state = Activation(predicate=original, allocator=allocator, env_previous=env_text(ENV_ACTIVE))
        try:
            cumem = importlib.import_module("vllm.device_allocator.cumem")
        except ImportError as exc:  # vLLM's CUDA extension cannot load: no CUDA here, nothing will allocate
            logger.warning("torpor: vLLM's cuMem module cannot be imported (%s); allocator slot left alone", exc)
        else:
            previous = cumem.CuMemAllocator.instance
            if previous is not None and previous is not allocator:
                used = int(previous.get_current_usage()) if hasattr(previous, "get_current_usage") else 0
                if used:
                    msg = (
                        f"cannot route vLLM through torpor in process {os.getpid()}: vLLM's "
                        f"{type(previous).__name__} already holds {used} bytes; select the 'torpor' backend "
                        "before the engine allocates (one engine per process)"
                    )
                    raise ActivationError(msg)
            state.slot_class, state.slot_previous = cumem.CuMemAllocator, previous
            cumem.CuMemAllocator.instance = allocator
        cls.use_cumem_cudagraph_pool = property(extended_predicate(original.fget), doc=original.__doc__)
        os.environ[ENV_ACTIVE] = "1"
        state.engine_previous = env_text(ENV_ENGINE)
        if not state.engine_previous:
            # One name per engine, shared by its ranks (they inherit the environment), never by two engines on a
            # host: the process that selects torpor first (the API server, or the LLM's process) names the engine.
            os.environ[ENV_ENGINE] = f"{DEFAULT_ENGINE}-{os.getpid()}"
        # The first process to activate gives the workers a metrics directory when none is named (a single API server
        # sets none); its children inherit it. torpor's series then reach vLLM's /metrics with no setting.
        state.metrics_dir = _provide_metrics_dir()
        if not _process.atexit_registered:
            atexit.register(_release_at_exit)
            _process.atexit_registered = True
        _process.active = state
        logger.info("torpor: active in process %d (allocator facade and graph-pool predicate installed)", os.getpid())
        return state


def deactivate() -> None:
    """Undo :func:`activate`: vLLM's predicate, the allocator slot and the environment as they were."""
    with _lock:
        state, _process.active = _process.active, None
        if state is None:
            return
        _vllm_config_class().use_cumem_cudagraph_pool = state.predicate
        if state.slot_class is not None and state.slot_class.instance is state.allocator:
            state.slot_class.instance = state.slot_previous
        if state.env_previous is None:
            os.environ.pop(ENV_ACTIVE, None)
        else:
            os.environ[ENV_ACTIVE] = state.env_previous
        if state.engine_previous is None:
            os.environ.pop(ENV_ENGINE, None)
        else:
            os.environ[ENV_ENGINE] = state.engine_previous
        if state.metrics_dir is not None:
            importlib.import_module("torpor.telemetry.multiprocess").withdraw_directory()


def _provide_metrics_dir() -> str | None:
    """The metrics directory this process made for its workers (None: one was named, or telemetry cannot load)."""
    try:
        path: str | None = importlib.import_module("torpor.telemetry.multiprocess").provide_directory()
    except Exception:  # telemetry is optional: the engine runs without it
        logger.exception("torpor: making a metrics directory for the workers failed; sleep and wake are unaffected")
        return None
    if path is not None:
        logger.info("torpor: workers write torpor's metrics to %s, served on the API server's /metrics", path)
    return path


def _release_at_exit() -> None:
    state = _process.active
    if state is not None and state.allocator is not None:
        try:
            state.allocator.release_pools()
        except Exception:  # interpreter shutdown must go on
            logger.exception("torpor: releasing the allocator at exit failed")
