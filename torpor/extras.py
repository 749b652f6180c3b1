"""Optional dependencies: the GPU parts need the ``cuda`` extra (torch and cuda-bindings).

``pip install .`` (from a checkout: torpor is on no package index) brings the state machine, the event log and its reader,
the command line, telemetry (Prometheus, OpenTelemetry API, the endpoint, the
dashboard) and the simulated device: none of them imports torch. The CUDA
allocator, graph capture and ``torpor bench`` need ``pip install '.[cuda]'`` from a checkout
(the ``vllm`` extra brings vLLM's own torch). :func:`require` imports a module
such a feature needs, or raises :class:`~torpor.errors.MissingExtra` saying what
to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from torpor.errors import MissingExtra

#: Top-level modules of the ``cuda`` extra and the distribution that provides each.
CUDA_MODULES: dict[str, str] = {"torch": "torch", "cuda": "cuda-bindings"}


def require(module: str, feature: str, extra: str = "cuda") -> ModuleType:
    """Import ``module`` for ``feature``; MissingExtra (an ImportError) naming the extra when it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != module.split(".", maxsplit=1)[0]:
            raise  # the module is there but one of its own imports failed: not a missing extra
        top = module.split(".", maxsplit=1)[0]
        raise MissingExtra(feature, CUDA_MODULES.get(top, top), extra, str(exc)) from exc


def available(module: str) -> bool:
    """True when ``module`` can be imported (without importing it when it is absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
