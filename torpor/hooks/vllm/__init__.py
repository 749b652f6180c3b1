"""torpor as a vLLM 0.33 plugin: sleep backend ``torpor``, its allocator, the extended predicate, HTTP routes.

``vllm serve MODEL --enable-sleep-mode --sleep-mode-backend torpor
[--sleep-mode-offload-cudagraph]`` with torpor installed with its vllm extra (`pip install '.[vllm]'` from a checkout). vLLM finds
the plugin through the ``vllm.general_plugins`` entry point
(:func:`~torpor.hooks.vllm.activation.register`) and the HTTP routes through
``vllm.endpoint_plugins`` (:func:`~torpor.hooks.vllm.endpoint.endpoint_plugin`,
opt-in with ``VLLM_PLUGINS``). See docs/vllm.md.

Importing this package imports neither vLLM nor FastAPI: vLLM is imported
when its plugin loader calls in; ``backend`` (which subclasses vLLM's
``SleepModeBackend``) and ``endpoint`` (FastAPI routes) are imported by vLLM
only.
"""

from __future__ import annotations

from torpor.errors import ActivationError, NotWired
from torpor.hooks.vllm.activation import (
    ENV_PROBE,
    activate,
    deactivate,
    install_probe,
    register,
    register_backend,
    remove_probe,
)
from torpor.hooks.vllm.facade import (
    TorporMemAllocator,
    configure,
    current_controller,
    get_instance,
)
from torpor.hooks.vllm.pooldecision import BACKEND, decision_for, extended_predicate, selects_torpor
from torpor.hooks.vllm.process import ENV_ACTIVE, Activation, is_active
from torpor.hooks.vllm.settings import DEFAULT_ENGINE, ENV_ENGINE, ENV_LOG_DIR, ENV_RANK, default_log_dir

__all__ = [
    "BACKEND",
    "DEFAULT_ENGINE",
    "ENV_ACTIVE",
    "ENV_ENGINE",
    "ENV_LOG_DIR",
    "ENV_PROBE",
    "ENV_RANK",
    "Activation",
    "ActivationError",
    "NotWired",
    "TorporMemAllocator",
    "activate",
    "configure",
    "current_controller",
    "deactivate",
    "decision_for",
    "default_log_dir",
    "extended_predicate",
    "get_instance",
    "install_probe",
    "is_active",
    "register",
    "register_backend",
    "remove_probe",
    "selects_torpor",
]
