"""A vLLM worker's torpor settings, from its environment and vLLM's process groups.

The log directory, engine name and rank a worker's controller records under, whether its log
fsyncs, and the policy it starts with under vLLM: host memory pinned ahead
(:func:`worker_host_policy`) and the KV cache released before the weights' backup
(:func:`worker_discard_first`). :mod:`torpor.hooks.vllm.facade` reads them when it starts a
worker's controller; nothing here imports vLLM (its groups are read from ``sys.modules``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from torpor.statemachine.core.enginename import check_engine_name
from torpor.statemachine.core.policy import HostMemoryPolicy, PinWhen
from torpor.switches import env_path, env_rank, env_switch, env_text

__all__ = [
    "DEFAULT_ENGINE",
    "ENV_DISCARD_FIRST",
    "ENV_ENGINE",
    "ENV_HOST_PIN",
    "ENV_LOG_DIR",
    "ENV_LOG_FSYNC",
    "ENV_RANK",
    "default_log_dir",
    "engine_name",
    "log_fsync",
    "worker_discard_first",
    "worker_host_policy",
    "worker_rank",
]

#: Directory every rank writes its event log into (``torpor status DIR`` reads it).
ENV_LOG_DIR = "TORPOR_LOG_DIR"
#: Engine name in the log file names (``ENGINE.rankN.jsonl``); ``-dpN`` is added under data parallelism.
ENV_ENGINE = "TORPOR_ENGINE"
#: Overrides the rank torpor reads from vLLM's world group.
ENV_RANK = "TORPOR_RANK"
#: ``0``: the worker's log does not fsync its boundary events (two per sleep, two per wake); default ``1``.
ENV_LOG_FSYNC = "TORPOR_LOG_FSYNC"
DEFAULT_ENGINE = "vllm"


#: When host memory for backups is pinned (``ahead`` | ``at_sleep``); under vLLM unset means ``ahead``.
ENV_HOST_PIN = "TORPOR_HOST_PIN"
#: ``0``: a sleep backs up and releases the weights before it releases the KV cache; default ``1`` under vLLM.
ENV_DISCARD_FIRST = "TORPOR_DISCARD_FIRST"


def worker_host_policy(environ: dict[str, str] | None = None) -> HostMemoryPolicy:
    """The host-memory policy of a vLLM worker: the ``TORPOR_HOST_*`` environment's, pinning ``ahead`` unless told.

    vLLM's sleep mode is switched on by the operator, so the engine will sleep, and its
    weights are known once loaded: pinning their backup memory in the background while
    the engine starts (within ``TORPOR_HOST_BUDGET``, paused while graphs are captured)
    makes the first sleep cost what a later one costs. ``TORPOR_HOST_PIN=at_sleep`` opts
    out (the first sleep then pins as it copies). Outside vLLM the default stays
    ``at_sleep`` (docs/allocator.md, "Host pinning by default").
    """
    env = dict(os.environ if environ is None else environ)
    if not (env_text(ENV_HOST_PIN, env) or "").strip():
        env[ENV_HOST_PIN] = PinWhen.AHEAD.value
    return HostMemoryPolicy.from_env(env)


def log_fsync() -> bool:
    """``$TORPOR_LOG_FSYNC``: whether the worker's log makes each boundary event durable (default yes).

    Off, a sleep or wake writes its events without waiting for the disk: a process
    that dies keeps them all (they are in the page cache), a host that loses power
    can lose the last ones (its GPU memory is gone too, and every worker starts awake).
    """
    return env_switch(ENV_LOG_FSYNC)


def worker_discard_first(environ: dict[str, str] | None = None) -> bool:
    """``$TORPOR_DISCARD_FIRST``: whether a vLLM worker's sleep releases the KV cache before its backup (default yes).

    vLLM forgets the KV cache's content before it sleeps (it clears the prefix
    cache at level 1 and 2), so releasing it first loses nothing vLLM keeps, and
    the driver's work on the freed memory then runs under the weights' copies
    instead of halving the link for a wake that follows at once (``Policy.discard_first``;
    docs/benchmarks.md, the 8B section). ``0`` keeps the offloaded-first order.
    """
    return env_switch(ENV_DISCARD_FIRST, environ)


def default_log_dir() -> Path:
    """``$TORPOR_LOG_DIR``, else ``<tempdir>/torpor-<uid>`` (``/tmp/torpor-1000``): one per user, 0700.

    A directory per user, so that one user's engines never block another's (a
    shared ``/tmp/torpor`` belongs to whoever made it first, and torpor refuses
    a log directory that belongs to someone else).
    """
    return env_path(ENV_LOG_DIR) or Path(tempfile.gettempdir()) / f"torpor-{os.geteuid()}"


def _group_attr(name: str, attr: str) -> int | None:
    """An attribute of one of vLLM's process groups, None when vLLM's distributed state is not up."""
    state = sys.modules.get("vllm.distributed.parallel_state")
    group = getattr(state, name, None) if state is not None else None
    value = getattr(group, attr, None) if group is not None else None
    return int(value) if isinstance(value, int) else None


def worker_rank() -> int:
    """This worker's rank: ``$TORPOR_RANK``, vLLM's world-group rank, torch.distributed's, ``$RANK``, else 0.

    Both variables are read by :func:`torpor.switches.env_rank`, as torpor.tms reads ``RANK``.
    """
    override = env_rank(ENV_RANK)
    if override is not None:
        return override
    rank = _group_attr("_WORLD", "rank_in_group")
    if rank is not None:
        return rank
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    rank = env_rank("RANK")
    return 0 if rank is None else rank


def engine_name() -> str:
    """``$TORPOR_ENGINE`` (``vllm-<pid>`` once activated, see ``activation.activate``), ``-dpN`` added under data parallelism.

    A name outside the engine-name rule (:mod:`torpor.statemachine.core.enginename`) is a ``ValueError``
    naming the variable, before a controller or the keeper sees it.
    """
    given = env_text(ENV_ENGINE)
    name = given or DEFAULT_ENGINE
    dp_size = _group_attr("_DP", "world_size")
    dp_rank = _group_attr("_DP", "rank_in_group")
    if dp_size is not None and dp_size > 1 and dp_rank is not None:
        name = f"{name}-dp{dp_rank}"
    return check_engine_name(name, source=f"${ENV_ENGINE}" if given else "")
