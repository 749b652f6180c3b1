"""What the TMS API drives: one torpor controller per TMS tag over one shared allocator, the regions, pause and resume.

:class:`TmsEngine` is torpor's counterpart of TMS's ``_TorchMemorySaverImpl``:
``region()`` routes this thread's allocations to a torpor tag (torch mode and,
until torpor's preload library is on ``LD_PRELOAD``, preload mode too:
``TaggedAllocator.use_memory_pool``); ``pause``/``resume`` are each TMS tag's
controller's ``sleep(1)``/``wake()``, so every one is a logged transition
with its events and metrics. All checks come before anything is touched: a
``pause`` of a tag not awake or a ``resume`` of a tag not paused raises
:class:`~torpor.errors.TagStateError` naming the tag and its state.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from torpor.allocator import TaggedAllocator
from torpor.errors import AllocatorError, TagStateError, TmsArgumentError, TmsUsageError
from torpor.hooks.nccl import apply_nccl_defaults
from torpor.hooks.predicate import cudagraph_pool_decision
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.states import State
from torpor.statemachine.machine.controller import SleepController
from torpor.switches import env_rank, env_switch, env_text
from torpor.telemetry.session import attach
from torpor.tms.envsettings import BACKENDS, TmsSettings
from torpor.tms.preload import PreloadHook, preloaded
from torpor.tms.switch import active
from torpor.tms.tagview import DISCARD_MODE, TagView, TmsTag, mode_of

logger = logging.getLogger("torpor.tms")

HOOK_MODES = ("preload", "torch")
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
LOG_DIR_ENV = "TORPOR_LOG_DIR"
ENGINE_ENV = "TORPOR_TMS_ENGINE"
TELEMETRY_ENV = "TORPOR_TMS_TELEMETRY"
#: Where ``disable()`` puts allocations: a torpor tag no TMS tag owns, so no pause ever touches it. TMS uses a fresh
#: torch ``MemPool`` there; inside torpor's pool torch would serve the outer (torpor) pool first (pools.py says why).
DISABLED_TAG = "torch_memory_saver.disabled"


def check_alloc_conf(environ: dict[str, str] | None = None) -> None:
    """Refuse ``expandable_segments:True`` in ``PYTORCH_CUDA_ALLOC_CONF``, as TMS does (its message, and why)."""
    conf = (os.environ if environ is None else environ).get(ALLOC_CONF, "")
    if "expandable_segments:True" in conf:
        msg = (
            "TorchMemorySaver is disabled for the current process because expandable_segments is not supported yet "
            f"({ALLOC_CONF}={conf!r}): expandable segments grow one mapping in place, which a pause cannot unmap "
            "and map back at the same address. Remove expandable_segments:True (torpor maps each tag itself)."
        )
        raise TmsUsageError(msg)


@dataclass(frozen=True)
class RegionConfig:
    """What a thread's innermost region says: TMS's thread-local config (tag, backup settings, enabled)."""

    tag: str
    mode: str
    interesting: bool = True


def _safe(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", tag) or "_"


def cuda_allocator() -> TaggedAllocator:
    """The allocator on CUDA a saver uses unless bound to one; where CUDA's driver is missing, refused in words.

    The refusal says the GPU is missing (torch too, where it is) and how to run
    without one, instead of the allocator's ``dlopen`` error.
    """
    try:
        return TaggedAllocator()
    except AllocatorError as exc:
        if exc.call != "dlopen":
            raise
        torch = "" if importlib.util.find_spec("torch") is not None else "; torch is not installed either"
        msg = (
            "torch_memory_saver (torpor.tms) needs a CUDA GPU: CUDA's driver library libcuda.so.1 cannot be opened "
            f"here{torch}. Without a GPU, bind the simulated device before the first region: "
            "torch_memory_saver.bind(TaggedAllocator(SimDriver(1 << 30))), from torpor.allocator"
        )
        raise TmsUsageError(msg) from exc


def _rank() -> int:
    """``$RANK`` as torpor's vLLM side reads it (:func:`torpor.switches.env_rank`); 0 when unset."""
    rank = env_rank("RANK")
    return 0 if rank is None else rank


class TmsEngine:
    """The state behind :class:`~torpor.tms.saver.TorchMemorySaver`, made at its first use (as TMS's impl is).

    ``allocator``: the :class:`TaggedAllocator` (None: a new one on CUDA).
    ``log``: a directory for the controllers' logs (None: ``TORPOR_LOG_DIR``, or
    in memory only), one file per TMS tag, ``ENGINE.TAG.rankN.jsonl``.
    ``telemetry``: attach torpor's telemetry to each controller (None:
    unless the switch ``TORPOR_TMS_TELEMETRY`` is off, :func:`torpor.switches.env_switch`).
    """

    def __init__(
        self,
        hook_mode: str = "preload",
        *,
        allocator: TaggedAllocator | None = None,
        log: str | None = None,
        engine: str | None = None,
        settings: TmsSettings | None = None,
        telemetry: bool | None = None,
    ) -> None:
        if hook_mode not in HOOK_MODES:
            msg = f"hook_mode must be one of {', '.join(HOOK_MODES)}, not {hook_mode!r}"
            raise TmsArgumentError(msg)
        check_alloc_conf()
        self.hook_mode = hook_mode
        self.settings = settings if settings is not None else TmsSettings.from_env()
        self.rank = _rank()
        self.telemetry = env_switch(TELEMETRY_ENV) if telemetry is None else telemetry
        self.allocator = allocator if allocator is not None else cuda_allocator()
        self.log_dir = log if log is not None else env_text(LOG_DIR_ENV)
        self.engine = engine or env_text(ENGINE_ENV) or "tms"
        self.retain_cpu_backup = self.settings.retain_cpu_backup
        self.cpu_backup_backend = self.settings.cpu_backup_backend
        self.disk_backup_dir = self.settings.disk_backup_dir
        self.memory_margin_bytes = 0
        self.tags: dict[str, TmsTag] = {}
        self.controllers: dict[str, SleepController] = {}
        self.graph_owner: str | None = None
        self._resumed: set[str] = set()  # TMS tags resumed at least once (a retained backup exists in TMS)
        self._telemetry: list[Any] = []
        self._lock = threading.RLock()
        self._local = threading.local()
        if self.allocator.on_cuda:  # TMS #88: no NCCL graph registration on the pool
            apply_nccl_defaults(cudagraph_pool_decision(True, True, "torpor", True, platform="cuda"))
        lib = preloaded() if hook_mode == "preload" else None
        self.preload = PreloadHook(lib, self.allocator.native_entry) if lib is not None else None
        if self.preload is not None and self.settings.init_enable:  # TMS_INIT_ENABLE=1: outside regions too
            initial = self._initial()
            default = self.torpor_tag(initial.tag, initial.mode)
            self.allocator.tag_state(default)
            self.preload.set_default(default)

    # -- the thread's region config ------------------------------------------------------

    def _stack(self) -> list[RegionConfig]:
        stack: list[RegionConfig] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = [self._initial()]
            self._local.stack = stack
        return stack

    def _initial(self) -> RegionConfig:
        s = self.settings
        mode = mode_of(s.init_enable_cpu_backup, s.init_enable_disk_backup, s.cpu_backup_backend)
        return RegionConfig("default", mode, s.init_enable)

    def current(self) -> RegionConfig:
        """This thread's config: the innermost region, ``disable()``, or the ``TMS_INIT_*`` one."""
        return self._stack()[-1]

    # -- tags and their controllers -------------------------------------------------------

    def controller(self, tag: str) -> SleepController:
        """The controller of TMS tag ``tag`` (made at first use)."""
        with self._lock:
            ctl = self.controllers.get(tag)
            if ctl is not None:
                return ctl
            entry = self.tags.setdefault(tag, TmsTag(tag))
            log = None if self.log_dir is None else os.path.join(self.log_dir, "")
            ctl = SleepController(
                TagView(self.allocator, entry),
                log=log,
                policy=entry.policy(),
                engine=f"{self.engine}.{_safe(tag)}",
                rank=self.rank,
            )
            self.controllers[tag] = ctl
            ctl.record(EventKind.HOOK_DECISION, hook="torch_memory_saver", active=True, detail=active())
            if self.telemetry:
                self._attach(ctl)
            return ctl

    def _attach(self, ctl: SleepController) -> None:
        try:
            self._telemetry.append(attach(ctl))
        except Exception:  # telemetry is optional: pause and resume run without it
            logger.exception("torpor.tms: attaching telemetry failed; pause and resume are unaffected")

    def torpor_tag(self, tag: str, mode: str) -> str:
        """The torpor tag of a region of ``tag`` in ``mode`` (its controller made too)."""
        self.controller(tag)
        with self._lock:
            return self.tags[tag].torpor_tag(mode)

    def torpor_tags(self) -> list[str]:
        """Every torpor tag of every TMS tag (the graph pool's too once a tag owns it)."""
        with self._lock:
            return sorted({t for entry in self.tags.values() for t in entry.actions})

    def mode_of_torpor_tag(self, torpor_tag: str) -> str:
        """The backup mode of ``torpor_tag`` (``discard``, ``pinned``, ``mmap``, ``disk``; the graph pool: ``pinned``)."""
        with self._lock:
            for entry in self.tags.values():
                for mode, tag in entry.modes.items():
                    if tag == torpor_tag:
                        return mode
        return "pinned"

    def resumed(self, torpor_tag: str) -> bool:
        """Whether the TMS tag of ``torpor_tag`` has been paused and resumed (TMS then holds a retained backup)."""
        with self._lock:
            return any(entry.owns(torpor_tag) and name in self._resumed for name, entry in self.tags.items())

    def adopt_graph_pool(self, tag: str) -> SleepController:
        """``tag`` owns the graph pool from now on (the first ``cuda_graph()`` tag); its controller."""
        ctl = self.controller(tag)
        with self._lock:
            if self.graph_owner not in (None, tag):
                msg = (
                    f"cuda_graph(tag={tag!r}): torpor's graph pool (one per process) already belongs to tag "
                    f"{self.graph_owner!r}; capture every graph under that one tag"
                )
                raise TmsUsageError(msg)
            self.graph_owner = tag
            self.tags[tag].adopt_graph_pool()
        return ctl

    # -- regions -----------------------------------------------------------------------------

    @contextmanager
    def region(
        self, tag: str, enable_cpu_backup: bool, enable_disk_backup: bool, backend: str | None
    ) -> Iterator[None]:
        """Allocations of this thread inside go to ``tag``'s torpor tag for these settings (nestable: inner wins)."""
        if enable_cpu_backup and enable_disk_backup:
            msg = "enable_cpu_backup and enable_disk_backup are mutually exclusive"
            raise TmsArgumentError(msg)
        resolved = backend or self.cpu_backup_backend
        if resolved not in BACKENDS:
            msg = f"cpu_backup_backend must be one of {', '.join(BACKENDS)}, not {resolved!r}"
            raise TmsArgumentError(msg)
        config = RegionConfig(tag, mode_of(enable_cpu_backup, enable_disk_backup, resolved))
        torpor_tag = self.torpor_tag(tag, config.mode)
        stack = self._stack()
        stack.append(config)
        try:
            with self.allocator.use_memory_pool(torpor_tag), self._raw(torpor_tag):
                yield
        finally:
            stack.pop()

    def _raw(self, torpor_tag: str | None) -> AbstractContextManager[None]:
        """Where this thread's raw cudaMalloc goes inside a block (preload mode with torpor's library loaded)."""
        return nullcontext() if self.preload is None else self.preload.tagged(torpor_tag)

    @contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations of this thread inside are never paused (:data:`DISABLED_TAG`); only inside a region, as TMS."""
        now = self.current()
        if not now.interesting:
            msg = "disable() should be called only when tms is active (inside a region(), or with TMS_INIT_ENABLE=1)"
            raise TmsUsageError(msg)
        stack = self._stack()
        stack.append(RegionConfig(now.tag, now.mode, interesting=False))
        try:
            with self.allocator.use_memory_pool(DISABLED_TAG), self._raw(None):
                yield
        finally:
            stack.pop()

    # -- pause and resume ------------------------------------------------------------------

    def _targets(self, tag: str | None) -> list[str]:
        if tag:  # TMS treats None and "" alike: every tag
            self.controller(tag)
            return [tag]
        with self._lock:
            return sorted(self.controllers)

    def pause(self, tag: str | None) -> None:
        """Pause ``tag`` (None: every tag): each its controller's ``sleep(1)``; all checked first, undone on failure."""
        targets = self._targets(tag)
        for t in targets:
            state = self.controllers[t].state
            if state not in (State.AWAKE, State.PARTIALLY_AWAKE):
                raise TagStateError("pause", t, state.value, (State.AWAKE.value, State.PARTIALLY_AWAKE.value))
        done: list[str] = []
        try:
            for t in targets:
                self.controllers[t].sleep(1)
                done.append(t)
        except BaseException:
            for t in reversed(done):  # all or nothing, as one sleep is
                try:
                    self.controllers[t].wake()
                except Exception:
                    logger.exception("torpor.tms: waking %r again after a failed pause failed", t)
            raise
        logger.info("torpor.tms: paused %s", ", ".join(targets) or "nothing (no tag yet)")

    def resume(self, tag: str | None) -> None:
        """Resume ``tag`` (None: every tag): each its controller's ``wake()``, at the same addresses; all checked first."""
        targets = self._targets(tag)
        asleep = (State.ASLEEP_L1.value, State.ASLEEP_L2.value)
        for t in targets:
            state = self.controllers[t].state
            if state.value not in asleep:
                raise TagStateError("resume", t, state.value, asleep)
        for t in reversed(targets):
            self.controllers[t].wake()
            self._resumed.add(t)
        logger.info("torpor.tms: resumed %s", ", ".join(targets) or "nothing (no tag yet)")

    def close(self) -> None:
        """Detach telemetry and close every controller (the allocator stays)."""
        for handle in self._telemetry:
            handle.detach()
        self._telemetry.clear()
        for ctl in self.controllers.values():
            ctl.close()


__all__ = ["DISABLED_TAG", "DISCARD_MODE", "HOOK_MODES", "RegionConfig", "TmsEngine", "check_alloc_conf"]
