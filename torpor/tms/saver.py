"""``TorchMemorySaver``: torch_memory_saver 0.0.10's public class, with its names, arguments and defaults, on torpor.

What a TMS user calls is here and nothing else: ``region``, ``cuda_graph``,
``disable``, ``pause``, ``resume``, ``enabled``, the write-only ``hook_mode``
and ``memory_margin_bytes``, ``retain_cpu_backup``, ``get_cpu_backup``,
``set_disk_backup_dir``. As in TMS the state is made at the first call
(``hook_mode`` must be set before it); torpor's one addition, :meth:`bind`,
hands it an allocator (a simulated one in tests) or a log directory first.
What the calls do is :class:`~torpor.tms.pausing.TmsEngine`'s.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

from torpor.allocator import CaptureHandle, TaggedAllocator
from torpor.errors import TmsArgumentError, TmsNotReadable, TmsUsageError, TmsWriteOnly
from torpor.tms.envsettings import CpuBackupBackend
from torpor.tms.hostcopy import backup_spans, not_found, owning_tag, read_spans
from torpor.tms.internals import TmsImpl
from torpor.tms.pausing import HOOK_MODES

logger = logging.getLogger("torpor.tms")

_TAG_DEFAULT = "default"


class TorchMemorySaver:
    """torch_memory_saver's saver on torpor's allocator and state machine (see the module docstring)."""

    def __init__(self) -> None:
        self._impl_ctor_kwargs: dict[str, Any] | None = {}
        self._impl: TmsImpl | None = None
        self._init_lock = threading.Lock()

    # -- torpor's addition ------------------------------------------------------------------

    def bind(
        self,
        allocator: TaggedAllocator | None = None,
        *,
        log: str | None = None,
        engine: str | None = None,
        telemetry: bool | None = None,
    ) -> None:
        """Before the first call: the allocator to use, where the logs go, the engine name, telemetry on or off."""
        kwargs = self._configurable("bind")
        kwargs.update(allocator=allocator, log=log, engine=engine, telemetry=telemetry)

    def _configurable(self, what: str) -> dict[str, Any]:
        if self._impl_ctor_kwargs is None:
            msg = f"Cannot configure after initialization ({what} must come before the saver's first region, pause or resume)"
            raise TmsUsageError(msg)
        return self._impl_ctor_kwargs

    # -- TMS's API --------------------------------------------------------------------------

    @contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """Allocations inside are pausable under ``tag``: with a CPU (or disk) backup restored at resume, or discarded."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized()
        with impl.region(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
            yield

    @contextmanager
    def cuda_graph(
        self,
        cuda_graph: Any,
        pool: Any = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """Like ``torch.cuda.graph``, into torpor's graph pool, which pausing ``tag`` offloads and resuming restores."""
        self._validate_cpu_backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized()
        ctl = impl.adopt_graph_pool(tag)
        if pool is not None:
            logger.debug("torpor.tms: cuda_graph(pool=%r) captures into torpor's graph pool instead", pool)
        with ctl.capture(f"torch_memory_saver.cuda_graph tag={tag}") as pool_handle:
            handle = cast(CaptureHandle, pool_handle)  # what TaggedAllocator.capture_into_pool yields
            with handle.graph(cuda_graph, stream=stream, capture_error_mode=capture_error_mode):
                yield

    @contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations inside are not the saver's (torch's own pool): never paused."""
        impl = self._ensure_initialized()
        with impl.disable():
            yield

    def pause(self, tag: str | None = None) -> None:
        """Pause memory for specific tag or all memory if tag is None."""
        self._ensure_initialized().pause(tag)

    def resume(self, tag: str | None = None) -> None:
        """Resume memory for specific tag or all memory if tag is None."""
        self._ensure_initialized().resume(tag)

    @property
    def enabled(self) -> bool:
        """Always True (TMS keeps it for compatibility)."""
        return True

    @property
    def hook_mode(self) -> str:
        """Write-only, as in TMS."""
        raise TmsWriteOnly("hook_mode is write-only")

    @hook_mode.setter
    def hook_mode(self, hook_mode: str) -> None:
        if hook_mode not in HOOK_MODES:
            msg = f"hook_mode must be one of {', '.join(HOOK_MODES)}, not {hook_mode!r}"
            raise TmsArgumentError(msg)
        self._configurable("hook_mode")["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self) -> int:
        """Write-only, as in TMS: reading it raises, with TMS's own words in the message for callers that match them."""
        msg = "memory_margin_bytes can be set, not read (TMS: Only setter is supported)"
        raise TmsNotReadable(msg)

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        if type(value) is not int or value < 0:
            msg = f"memory_margin_bytes must be a number of bytes (an int, 0 or more), not {value!r}"
            raise TmsArgumentError(msg)
        self._ensure_initialized().memory_margin_bytes = value

    @property
    def retain_cpu_backup(self) -> bool:
        """Whether ``get_cpu_backup`` answers for a resumed tag (``TMS_RETAIN_CPU_BACKUP``)."""
        return self._ensure_initialized().retain_cpu_backup

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized().retain_cpu_backup = bool(value)

    def get_cpu_backup(self, x: Any, zero_copy: bool = False) -> Any:
        """The host copy of tensor ``x`` (contiguous, on the GPU) a pause made, or None when its region keeps none."""
        impl = self._ensure_initialized()
        if not (getattr(x, "is_cuda", False) or getattr(x, "is_xpu", False)):
            msg = f"get_cpu_backup takes a tensor on the GPU, not one on {getattr(x, 'device', type(x).__name__)}"
            raise TmsUsageError(msg)
        if not x.is_contiguous():
            msg = f"get_cpu_backup takes a contiguous tensor ({tuple(x.shape)}, stride {x.stride()})"
            raise TmsUsageError(msg)
        import torch

        address, nbytes = x.data_ptr(), x.nbytes
        host = impl.cpu_backup_pointer(address, nbytes)
        if host is not None:
            raw: Any = (ctypes.c_ubyte * nbytes).from_address(host)  # the backup itself (TMS: a numpy view of it)
            flat = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            view = flat.view(x.dtype).view(x.shape)
            return view if zero_copy else view.clone()
        tags = impl.torpor_tags()
        spans = backup_spans(impl.allocator, tags, address, nbytes)  # the graph pool keeps the allocator's backup
        if spans is not None:
            flat = torch.frombuffer(bytearray(read_spans(spans)), dtype=torch.uint8) if nbytes else torch.empty(0)
            return flat.view(x.dtype).view(x.shape)
        if owning_tag(impl.allocator, tags, address, nbytes) is None:
            raise not_found(address, nbytes)
        return None  # no backup held: a region without one, a resumed one not retained, or a disk one (TMS: None)

    def set_disk_backup_dir(self, path: str) -> None:
        """Where a disk-backed region's backup goes (made when missing): one file per allocation while paused."""
        impl = self._ensure_initialized()
        os.makedirs(path, exist_ok=True)
        impl.disk_backup_dir = path

    # -- TMS's private helpers, kept by name ------------------------------------------------------

    def _validate_cpu_backup_backend(self, enable_cpu_backup: bool, cpu_backup_backend: str | None) -> None:
        if cpu_backup_backend is None:
            return
        if not enable_cpu_backup:
            msg = f"cpu_backup_backend={cpu_backup_backend!r} requires enable_cpu_backup=True (a region without it keeps no copy)"
            raise TmsArgumentError(msg)
        if cpu_backup_backend not in ("mmap", "pinned"):
            msg = f"cpu_backup_backend must be 'mmap' or 'pinned', not {cpu_backup_backend!r}"
            raise TmsArgumentError(msg)

    def _ensure_initialized(self) -> TmsImpl:
        with self._init_lock:
            if self._impl is None:
                self._impl = TmsImpl(**(self._impl_ctor_kwargs or {}))
                self._impl_ctor_kwargs = None
            return self._impl
