"""vLLM load format ``torpor-keeper``: a restarted engine takes its weights from the keeper, else from disk as ``auto``.

Why: ``vllm serve M --load-format torpor-keeper --sleep-mode-backend torpor``
restarted after a crash should serve again with the weights its dead process
held asleep (the trainer's latest push, in RL), not the checkpoint's. The
loader claims the keeper's backup and pins it while it builds the model as
any loader does (:func:`~torpor.keeper.prefetching.prefetch`), then
:func:`~torpor.keeper.adoption.adopt`\\ s the keeper's backup of engine ``$TORPOR_KEEPER_ENGINE-rank<N>`` (the identity is
the model's parameters and buffers and ``model@revision``); with nothing to
adopt (no keeper, no backup, a mismatch) it loads the checkpoint with vLLM's
default loader and says why. Once loaded, the weights are tracked by a keeper
backing on torpor's allocator (when the torpor sleep backend runs), so the next
sleep's backup is kept in turn. What does not change: without
``--load-format torpor-keeper`` nothing here runs; it is registered by torpor's
vLLM plugin (:mod:`torpor.hooks.vllm.activation`) only when ``$TORPOR_KEEPER_ENGINE`` is set.

It lives with the vLLM integration, which it is part of, and uses the keeper through
its public modules: the keeper imports nothing of vLLM's integration, so importing
either never runs the other's package ``__init__`` in a loop.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torpor.allocator import TaggedAllocator
from torpor.hooks.vllm import process
from torpor.hooks.vllm.facade import get_instance
from torpor.hooks.vllm.settings import worker_rank
from torpor.keeper.adoption import adopt, track_model
from torpor.keeper.backing import KeeperBacking, attach
from torpor.keeper.prefetching import prefetch
from torpor.statemachine.machine.controller import SleepController
from torpor.switches import env_text

__all__ = ["ENV_ENGINE", "LOAD_FORMAT", "engine_for_rank", "register", "source_of"]

logger = logging.getLogger("torpor.keeper")

#: The load format's name.
LOAD_FORMAT = "torpor-keeper"
#: The environment variable naming the engine across restarts (vLLM's own engine name has the pid in it).
ENV_ENGINE = "TORPOR_KEEPER_ENGINE"

_backings: list[KeeperBacking] = []  # this process's backing (kept alive with the process)


def engine_for_rank(rank: int | None = None) -> str:
    """``$TORPOR_KEEPER_ENGINE-rank<N>``: a keeper engine name per worker, the same in the next process."""
    base = env_text(ENV_ENGINE) or "vllm"
    return f"{base}-rank{worker_rank() if rank is None else rank}"


def source_of(model_config: Any) -> str:
    """The identity's source: vLLM's model and its revision (``main`` when none is given)."""
    return f"{model_config.model}@{getattr(model_config, 'revision', None) or 'main'}"


def _controller() -> SleepController | None:
    """This worker's torpor controller (made now if vLLM has not asked for it yet); None when torpor is not active."""
    return get_instance().controller if process.is_active() else None


def _keep(model: Any, source: str) -> None:
    """Track the loaded weights with a keeper backing on torpor's allocator (when the torpor backend runs)."""
    ctl = _controller()
    if ctl is None or not isinstance(ctl.memory, TaggedAllocator):
        logger.warning("the torpor sleep backend is not active here: this engine's backups are not kept")
        return
    backing = attach(ctl.memory, ctl, engine=engine_for_rank())
    if backing.gone is None:
        track_model(backing, model, source)
        _backings.append(backing)


def _prefetch() -> None:
    """Claim this rank's kept backup and pin it for the current GPU while vLLM builds the model (None kept: no-op)."""
    import torch

    prefetch(engine=engine_for_rank(), device=torch.cuda.current_device() if torch.cuda.is_available() else None)


def loader_class() -> type:
    """The ``BaseModelLoader`` subclass (made on first use: vLLM is imported only then)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class KeeperModelLoader(BaseModelLoader):  # type: ignore[misc]  # vLLM's classes carry no annotations here
        """Adopt from the keeper, else load the checkpoint as ``auto``; then keep this engine's backups."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.disk = DefaultModelLoader(dataclasses.replace(load_config, load_format="auto"))

        def download_model(self, model_config: Any) -> None:
            self.disk.download_model(model_config)

        def load_weights(self, model: Any, model_config: Any) -> None:
            adopt(
                model,
                source=source_of(model_config),
                engine=engine_for_rank(),
                controller=_controller(),
                fallback=lambda: self.disk.load_weights(model, model_config),
            )

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> Any:
            _prefetch()  # the backup is pinned while the model is built; load_weights adopts it
            model = super().load_model(vllm_config, model_config, prefix)
            _keep(model, source_of(model_config))
            return model

    return KeeperModelLoader


def register() -> bool:
    """Register load format ``torpor-keeper`` with vLLM; False when vLLM is not importable."""
    try:
        from vllm.model_executor.model_loader import register_model_loader
    except ImportError:
        return False
    register_model_loader(LOAD_FORMAT)(loader_class())
    return True
