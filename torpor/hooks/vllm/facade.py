"""The allocator vLLM gets when ``torpor`` is selected: vLLM's ``MemAllocator`` calls on torpor's TaggedAllocator.

``get_mem_allocator_instance()`` returns ``CuMemAllocator.get_instance()`` on
CUDA, and that returns the ``CuMemAllocator.instance`` singleton; while torpor is
active that slot holds the process's :class:`TorporMemAllocator`. It answers
every call vLLM 0.33 makes on the instance (docs/vllm.md lists them; a test
keeps the list honest against the installed vLLM): ``use_memory_pool(tag)``,
``get_current_usage()``, ``cudagraph_pool()``, ``release_pools()`` and the
protocol's ``sleep``/``discard``/``wake_up``. Memory is a
``torpor.allocator.TaggedAllocator`` (CUDA unless given another), and every
command goes through the process's ``SleepController`` (one per worker, with
the worker's rank), which writes ``ENGINE.rankN.jsonl`` into the shared log
directory that ``torpor status DIR`` reads.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from torpor.errors import (
    CommandInFlight,
    ControllerClosed,
    NotWired,
)
from torpor.hooks.capture import cumem_capture
from torpor.hooks.vllm import process
from torpor.hooks.vllm.settings import (
    default_log_dir,
    engine_name,
    log_fsync,
    worker_discard_first,
    worker_host_policy,
    worker_rank,
)
from torpor.hooks.vllm.wiring import on_controller_started, record_when_known
from torpor.statemachine.core.policy import DEFAULT_POLICY, DEFAULT_TAG, WEIGHTS, Policy
from torpor.statemachine.core.protocol import Memory
from torpor.statemachine.machine.controller import SleepController, log_path_for

logger = logging.getLogger("torpor.vllm")

#: How long ``release_pools()`` (vLLM's shutdown, torpor's atexit) waits for a command in flight.
CLOSE_TIMEOUT_S = 60.0


def _default_memory() -> Memory:
    allocator = importlib.import_module("torpor.allocator")
    memory: Memory = allocator.TaggedAllocator(driver=None)
    return memory


def _capture_site() -> str:
    """The vLLM function capturing (the first frame outside contextlib and the routing helpers)."""
    skip = ("contextlib.py", "cudagraph_pool.py", __file__)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.endswith(skip):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "capture"
    module = frame.f_globals.get("__name__", "?")
    return f"{module}:{frame.f_code.co_qualname}"


class TorporMemAllocator:
    """vLLM's allocator singleton, backed by torpor's TaggedAllocator and guarded by a SleepController.

    Nothing is created until vLLM first uses it (in the worker, after the
    distributed state is up): then the memory (``memory`` or a CUDA
    ``TaggedAllocator``) and the controller (log directory, engine, rank as
    given or as read from vLLM and the environment).
    """

    default_tag = DEFAULT_TAG  # as vLLM's CuMemAllocator.default_tag

    def __init__(
        self,
        memory: Memory | None = None,
        *,
        log_dir: str | Path | None = None,
        engine: str | None = None,
        rank: int | None = None,
        policy: Policy | None = None,
        fsync: bool | None = None,
    ) -> None:
        self._memory = memory
        self._log_dir = log_dir
        self._engine = engine
        self._rank = rank
        self._policy = policy
        self._fsync = fsync
        self._controller: SleepController | None = None
        self._lock = threading.RLock()
        self._sites = itertools.count(1)
        self._closed = False
        self._closed_controller: SleepController | None = None
        self._decisions_recorded = False
        self.telemetry: Any = None

    # -- the lazy parts ---------------------------------------------------------

    @property
    def memory(self) -> Memory:
        """The memory vLLM's tensors live in (created on first use: a CUDA TaggedAllocator unless given)."""
        with self._lock:
            if self._memory is None:
                self._memory = _default_memory()
            return self._memory

    @property
    def configured(self) -> bool:
        """True when a memory was given (or has been created): the allocator has something to run on."""
        return self._memory is not None

    @property
    def started(self) -> bool:
        """True once the controller exists (vLLM has used this allocator in this process)."""
        return self._controller is not None

    @property
    def controller(self) -> SleepController:
        """This worker's SleepController, created on first use with the worker's rank; ``ControllerClosed`` once released."""
        with self._lock:
            if self._closed:
                closed = self._closed_controller
                engine, rank = (closed.engine, closed.rank) if closed is not None else (self._engine or "?", -1)
                seq = closed.last_seq if closed is not None else 0
                raise ControllerClosed("use the allocator after release_pools()", engine, rank, seq)
            if self._controller is None:
                self._controller = self._start()
            return self._controller

    def _start(self) -> SleepController:
        log_dir = Path(self._log_dir) if self._log_dir is not None else default_log_dir()
        engine = self._engine or engine_name()
        rank = self._rank if self._rank is not None else worker_rank()
        policy = self._policy
        if policy is None:  # vLLM's: its KV cache is forgotten before a sleep, so it goes first (unless told)
            policy = dataclasses.replace(DEFAULT_POLICY, discard_first=worker_discard_first())
        if policy.host is None:  # the environment's, with vLLM's default: pin ahead (worker_host_policy)
            policy = dataclasses.replace(policy, host=worker_host_policy())
        controller = SleepController(  # the log file's directory is created 0700 (or checked) by the log
            self.memory,
            log=log_path_for(log_dir, engine, rank),
            policy=policy,
            engine=engine,
            rank=rank,
            fsync=self._fsync if self._fsync is not None else log_fsync(),
        )
        if controller.projection.interrupted and controller.projection.pid != os.getpid():
            # The log ends inside a transition of an earlier process; this one starts with fresh memory.
            logger.warning(
                "torpor: %s ends in %r from process %d; recording a recovery for this new process",
                controller.log.path if controller.log else log_dir,
                controller.state.value,
                controller.projection.pid,
            )
            controller.recover()
        self._decisions_recorded = on_controller_started(controller, self)
        logger.info("torpor: engine %s rank %d logs to %s", engine, rank, log_dir)
        return controller

    # -- vLLM's MemAllocator protocol ---------------------------------------------

    @contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """Allocations inside the block go to the pool of ``tag`` (vLLM: ``weights``, ``kv_cache``, ``runtime``)."""
        tag = tag or self.default_tag
        controller = self.controller
        pool = getattr(self.memory, "use_memory_pool", None)
        with pool(tag) if callable(pool) else nullcontext():
            yield
        controller.observe()

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """vLLM's allocator-level sleep, as a controller sleep: level 1 when ``weights`` is offloaded, else 2.

        torpor's policy decides each tag (weights offloaded at level 1 and
        discarded at level 2, kv_cache discarded, every other tag offloaded);
        a requested set that differs is logged.
        """
        tags = (offload_tags,) if isinstance(offload_tags, str) else offload_tags
        level = 1 if tags is None or WEIGHTS in tags else 2
        if tags is not None:
            planned = self.controller.policy.plan(level, self.memory.usage())
            differ = sorted(t for t, action in planned.items() if (t in tags) != (action.value == "offload"))
            if differ:
                logger.warning(
                    "torpor: sleep(offload_tags=%s) ran as level %d; torpor's policy decides %s differently",
                    tags,
                    level,
                    ", ".join(differ),
                )
        self.controller.sleep(level, idempotent=True)  # a retry on a rank already asleep is a recorded no-op

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Drop the host backup of asleep ``tags`` (``SleepController.discard``)."""
        self.controller.discard([tags] if isinstance(tags, str) else list(tags))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake ``tags`` (None: all); every tag other than weights and kv_cache comes back with any wake.

        Every tag asked for resident already (a retry after another rank failed): a recorded no-op.
        """
        self.controller.wake(tags, idempotent=True)

    def get_current_usage(self) -> int:
        """Bytes of every allocation in the pools (resident, on the host or discarded), as CuMemAllocator counts."""
        return sum(u.resident + u.host + u.discarded for u in self.memory.usage().values())

    # -- what vLLM 0.33 calls beyond the protocol -----------------------------------

    @contextmanager
    def cudagraph_pool(self) -> Iterator[Any]:
        """Tag graph-capture allocations ``cudagraph`` and yield the graph pool's id (``SleepController.capture``)."""
        site = f"{_capture_site()} #{next(self._sites)}"
        controller = self.controller
        if not self._decisions_recorded:
            self._decisions_recorded = record_when_known(controller)
        with cumem_capture(controller, site) as pool:  # the graph-pool hooks (NCCL) follow the pool
            yield pool

    def release_pools(self) -> None:
        """Close the controller (a ``closed`` event) and let the memory drop its pools; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            controller, self._controller = self._controller, None
        if self.telemetry is not None:
            try:
                self.telemetry.detach()
            except Exception:  # teardown must go on
                logger.exception("torpor: detaching telemetry failed")
        if controller is not None:
            self._closed_controller = controller
            try:
                controller.close(timeout=CLOSE_TIMEOUT_S)
            except CommandInFlight:  # a command that never ends: closing the memory under it would be worse
                logger.exception("torpor: a command is still in flight after %.0f s; memory left open", CLOSE_TIMEOUT_S)
                return
        closer = getattr(self._memory, "close", None)
        if callable(closer):
            closer()

    def close(self) -> None:
        """Alias of :meth:`release_pools` (as on CuMemAllocator)."""
        self.release_pools()

    # -- torpor's own ---------------------------------------------------------------

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool once no graph uses it (refused while asleep or referenced); bytes it held."""
        return self.controller.release_cudagraph_pool()


class _Slot:
    """The process's facade (one allocator per process, as vLLM's CuMemAllocator)."""

    allocator: TorporMemAllocator | None = None


_facade_lock = threading.Lock()
_slot = _Slot()


def get_instance() -> TorporMemAllocator:
    """The process's allocator facade (created, lazily, on first call)."""
    with _facade_lock:
        if _slot.allocator is None:
            _slot.allocator = TorporMemAllocator()
        return _slot.allocator


def configure(allocator: TorporMemAllocator | None) -> TorporMemAllocator | None:
    """Make ``allocator`` the process's facade (None: a fresh default next time); returns the previous one.

    For tests and for a process that wants its own memory (a simulated
    device), log directory or policy; call it before vLLM first allocates.
    """
    with _facade_lock:
        previous, _slot.allocator = _slot.allocator, allocator
    return previous


def current_controller() -> SleepController | None:
    """The controller of this process's facade, None when vLLM has not used it yet."""
    with _facade_lock:
        current = _slot.allocator
    return current._controller if current is not None else None


def require_controller(what: str) -> SleepController:
    """The controller, or :class:`NotWired` naming why vLLM is not on torpor's allocator here."""
    if not process.is_active():
        msg = (
            f"cannot {what}: sleep backend 'torpor' is selected but torpor is not active in process {os.getpid()}, "
            "so vLLM allocated its memory with CuMemAllocator; the plugin activates when a VllmConfig selecting "
            f"torpor is built in this process or a parent, or when {process.ENV_ACTIVE}=1 is set "
            "(needed for launchers that pass no environment, e.g. Ray without VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY=TORPOR_)"
        )
        raise NotWired(msg)
    return get_instance().controller
