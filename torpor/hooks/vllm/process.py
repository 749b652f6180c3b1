"""This process's activation of the vLLM plugin: what :mod:`~torpor.hooks.vllm.activation` changed, and whether it is on.

The state lives apart from the code that changes it so that the facade and the
wiring can ask whether torpor is active without importing the activation (which
imports the facade): the vLLM integration's modules then import in one direction,
process <- facade <- activation. The facade held here is read through
:class:`PoolReleaser` (what the activation calls on it at exit), not imported.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torpor.hooks.nccl import NcclDecision
    from torpor.hooks.predicate import CudagraphPoolDecision

#: Set by :func:`~torpor.hooks.vllm.activation.activate`; a process that loads the plugin with it set activates at once (spawned workers).
ENV_ACTIVE = "TORPOR_VLLM_ACTIVE"


class PoolReleaser(Protocol):
    """What the activation keeps of the allocator facade it installed: at exit, its pools are released."""

    def release_pools(self) -> None: ...


@dataclass
class Activation:
    """What :func:`~torpor.hooks.vllm.activation.activate` changed, so :func:`~torpor.hooks.vllm.activation.deactivate` can put it back."""

    predicate: property
    slot_class: Any = None
    slot_previous: Any = None
    env_previous: str | None = None
    engine_previous: str | None = None
    metrics_dir: str | None = None  # the metrics directory this activation made for the workers
    allocator: PoolReleaser | None = None
    decisions: list[CudagraphPoolDecision] = field(default_factory=list)
    nccl: list[NcclDecision] = field(default_factory=list)


class _Process:
    """What this process has changed in vLLM (process-wide by nature: vLLM's classes are)."""

    active: Activation | None = None
    probe_original: Callable[..., Any] | None = None
    atexit_registered = False


_lock = threading.RLock()
_process = _Process()


def is_active() -> bool:
    """True while :func:`~torpor.hooks.vllm.activation.activate` is in effect in this process."""
    return _process.active is not None


def current() -> Activation | None:
    """The activation in effect (None: inactive)."""
    return _process.active
