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

When vLLM runs the engine on more than one rank, the backend puts the
controller in a group over the engine's ranks (vLLM's world group, or the
replica's group under data parallelism) before the first command, so that
``suspend``, ``resume`` and ``discard`` complete on every rank or on none
(docs/groups.md). vLLM's executor fans each command out to every worker and
marks the engine asleep or awake only when every worker returned; with the
group, a failure on one rank rolls every rank back and every worker raises
``GroupFailed``, so the executor's view and torpor's stay the same and a
retry of the same command runs on every rank from the same state.
``TORPOR_GROUP=0`` turns this off; ``TORPOR_GROUP_TIMEOUT`` sets the seconds
a rank waits for the others (default 120).

This module imports vLLM (the base class); vLLM imports it only when the
``torpor`` backend is selected.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any, Literal

from torpor.hooks.vllm.facade import get_instance, require_controller
from torpor.statemachine.core.states import State
from torpor.statemachine.machine.group import GroupMember, as_agreement, parse_timeout
from torpor.switches import env_switch, env_text

if TYPE_CHECKING:
    from torpor.statemachine.machine.controller import SleepController

    _Base = object
else:
    _Base = importlib.import_module("vllm.device_allocator.sleep_mode_backend").SleepModeBackend

SleepModeState = Literal["RUNNING", "SUSPENDED", "RESUMING"]

logger = logging.getLogger("torpor.vllm")

#: ``0`` keeps every rank deciding alone (no group); anything else, or unset, groups a multi-rank engine.
ENV_GROUP = "TORPOR_GROUP"
#: Seconds a rank waits for the other ranks' votes.
ENV_GROUP_TIMEOUT = "TORPOR_GROUP_TIMEOUT"


def engine_group() -> Any | None:
    """vLLM's group of this engine replica's ranks (a ``GroupCoordinator``), None when vLLM's groups are not up.

    The world group, unless data parallelism puts several replicas in it:
    then the replica's inner world group, or its tensor-parallel group when
    the replica has no pipeline stages; None when no vLLM group is exactly
    the replica.
    """
    state = sys.modules.get("vllm.distributed.parallel_state")
    if state is None:
        return None
    inner = getattr(state, "_INNER_DP_WORLD", None)
    world = getattr(state, "_WORLD", None)
    dp = getattr(state, "_DP", None)
    if inner is not None and inner is not world:
        return inner
    if world is None or dp is None or int(getattr(dp, "world_size", 1)) <= 1:
        return world
    pp = getattr(state, "_PP", None)
    if pp is None or int(getattr(pp, "world_size", 1)) <= 1:
        return getattr(state, "_TP", None)
    logger.warning("torpor: no vLLM group is exactly this replica (data and pipeline parallel): ranks decide alone")
    return None


def join_engine_group(controller: SleepController) -> bool:
    """Put ``controller`` in a group over the engine's ranks when there is more than one; True when it joined."""
    if controller.group is not None or not env_switch(ENV_GROUP):
        return False
    coordinator = engine_group()
    if coordinator is None or int(getattr(coordinator, "world_size", 1)) <= 1:
        return False
    timeout = parse_timeout(env_text(ENV_GROUP_TIMEOUT), ENV_GROUP_TIMEOUT)  # ValueError naming it
    group = coordinator.cpu_group
    if type(group).__module__.startswith("torch"):
        from torpor.torchgroup import TorchGroup

        group = TorchGroup(group, name=controller.engine)
    controller.group = GroupMember(as_agreement(group), timeout)
    logger.info(
        "torpor: %s rank %d sleeps and wakes as one of a group of %d ranks (timeout %g s)",
        controller.engine,
        controller.rank,
        controller.group.agreement.size,
        timeout,
    )
    return True


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
        join_engine_group(self._controller)  # vLLM creates the backend on every worker at once (first sleep)

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
