"""The ``torpor`` sleep backend: vLLM's ``SleepModeBackend`` calls, each through the worker's SleepController.

vLLM's worker creates the backend on its first sleep
(``SleepModeBackendFactory.create_backend``) and calls ``suspend(level)``,
``resume(tags)`` and ``discard(tags)``; ``state()`` tells ``/health`` whether the
engine serves. Each call is a guarded controller command: an invalid one is
refused with a reason that names the state (and is recorded as an event), and
what it did is recorded in the rank's event log. vLLM's executor sends each call
to every rank and counts it done only when every rank succeeded, so after one
rank failed the orchestrator repeats it on all of them: a repeated ``suspend``
or ``resume`` whose effect already holds on this rank (asleep at that level or
deeper; every tag asked for resident) is a no-op, recorded as a
``command_repeated`` event, not a refusal. The capability classmethods
answer for torpor's mechanism: memory is released and restored inside the
process, so communicators, compiled artifacts and CUDA graphs stay valid, and
nothing survives the process.

This module imports vLLM (the base class); vLLM imports it only when the
``torpor`` backend is selected.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Literal

from torpor.hooks.vllm.facade import require_controller
from torpor.statemachine.states import State

if TYPE_CHECKING:
    from torpor.statemachine.controller import SleepController

    _Base = object
else:
    _Base = importlib.import_module("vllm.device_allocator.sleep_mode_backend").SleepModeBackend

SleepModeState = Literal["RUNNING", "SUSPENDED", "RESUMING"]

#: torpor's states as vLLM's three: only ``awake`` serves; partially awake is a staged resume.
STATE_MAP: dict[State, SleepModeState] = {
    State.AWAKE: "RUNNING",
    State.SUSPENDING: "SUSPENDED",
    State.ASLEEP_L1: "SUSPENDED",
    State.ASLEEP_L2: "SUSPENDED",
    State.PARTIALLY_AWAKE: "RESUMING",
    State.RESUMING: "RESUMING",
}


class TorporSleepBackend(_Base):  # type: ignore[misc, valid-type]
    """Sleep backend ``torpor``: suspend, resume and discard through this worker's SleepController."""

    def __init__(self) -> None:
        super().__init__()
        self._controller: SleepController = require_controller("create the 'torpor' sleep backend")

    @property
    def controller(self) -> SleepController:
        """The worker's controller (rank, log, projection)."""
        return self._controller

    def suspend(self, level: int = 1) -> None:
        """Sleep at ``level``: offload weights (level 1) or discard them (level 2); kv_cache discarded; graphs offloaded.

        Already asleep at ``level`` or deeper (a retry after another rank failed): a recorded no-op.
        """
        self._controller.sleep(level, idempotent=True)

    def resume(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (None: all); every tag other than weights and kv_cache comes back with any wake.

        Every tag asked for resident already (a retry after another rank failed): a recorded no-op.
        """
        self._controller.wake(tags, idempotent=True)

    def discard(self, tags: tuple[str, ...]) -> None:
        """Drop the host backups of asleep ``tags`` (their next wake maps fresh memory); refused while awake."""
        self._controller.discard(list(tags))

    def state(self) -> SleepModeState:
        """``RUNNING`` when awake, ``SUSPENDED`` while going to sleep or asleep, ``RESUMING`` while waking or partially awake."""
        return STATE_MAP[self._controller.state]

    def projection(self) -> dict[str, Any]:
        """torpor's full view of this rank (state, per-tag residency, pool, graphs)."""
        return self._controller.projection.to_dict()

    # -- capabilities (no instance needed) -------------------------------------------

    @classmethod
    def is_supported(cls) -> bool:
        """True where torpor's allocator can run: CUDA (not ROCm) is available, or a memory was configured (a simulated device)."""
        from torpor.hooks.vllm.facade import get_instance

        if get_instance().configured:
            return True
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            return False
        return bool(torch.cuda.is_available() and not getattr(torch.version, "hip", None))

    @classmethod
    def preserves_communicators(cls) -> bool:
        """True: only memory in torpor's pools is released; NCCL communicators are left alone."""
        return True

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        """True: the process lives on, so torch.compile and JIT kernels survive."""
        return True

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        """True: communicators stay and memory comes back at the same addresses, so captured graphs replay."""
        return True

    @classmethod
    def supports_durable_storage(cls) -> bool:
        """False: backups live in this process's host memory only."""
        return False
