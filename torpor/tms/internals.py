"""``TmsImpl``: :class:`~torpor.tms.pausing.TmsEngine` with the parts of TMS's ``_TorchMemorySaverImpl`` its users reach.

TMS's own tests (and code written against them) read the saver's state
through ``_impl``: ``_binary_wrapper.cdll`` (the C configuration and entry
points, :mod:`torpor.tms.binarywrapper`), ``_mem_pools`` (one pool per tag,
backup settings and device: dropping one gives its free memory back, and the
backups of what it held) and ``_with_region_config(...)``. This class adds
them, keeps the C side's per-thread settings in step with each ``region()``
and ``disable()``, and holds the CPU and disk backups
(:class:`~torpor.tms.shadows.ShadowStore`) with ``retain_cpu_backup``, the
disk directory and ``memory_margin_bytes`` read from the C side, as TMS does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torpor.allocator import TaggedAllocator
from torpor.tms.binarywrapper import BinaryWrapper, process_wrapper
from torpor.tms.pausing import DISABLED_TAG, TmsEngine
from torpor.tms.shadows import DISK, ShadowStore
from torpor.tms.tagview import mode_of

logger = logging.getLogger("torpor.tms")

PoolKey = tuple[str, bool, bool, str, int]  # tag, enable_cpu_backup, enable_disk_backup, backend, device


def adopt_context(allocator: TaggedAllocator, ctx: int) -> TaggedAllocator:
    """``allocator`` working on the native table ``ctx`` (which the preload library opened), not on its own new one.

    Made before anything was allocated through ``allocator``: its own context is
    closed unused, and the tag ids it learned are asked again of ``ctx``.
    """
    allocator.native_entry.adopt(ctx)
    logger.info(
        "torpor.tms: TMS_INIT_ENABLE=1: the saver adopts the table that served cudaMalloc from the process start"
    )
    return allocator


class PoolRef:
    """One entry of ``_mem_pools``: dropping the last reference gives back its torpor tag's free memory and backups."""

    def __init__(self, impl: TmsImpl, torpor_tag: str) -> None:
        self.impl = impl
        self.torpor_tag = torpor_tag

    def __del__(self) -> None:
        try:
            self.impl.pool_dropped(self.torpor_tag)
        except Exception:  # a finalizer never raises
            logger.debug("torpor.tms: giving back a dropped pool's memory failed", exc_info=True)


class MemPools(dict[PoolKey, PoolRef]):
    """``_mem_pools``: made on first use of a key (TMS's ``defaultdict`` of ``MemPool``)."""

    def __init__(self, impl: TmsImpl) -> None:
        super().__init__()
        self._impl = impl

    def __missing__(self, key: PoolKey) -> PoolRef:
        tag, cpu, disk, backend, _ = key
        ref = self[key] = PoolRef(self._impl, self._impl.torpor_tag_of(tag, cpu, disk, backend or None))
        return ref


class TmsImpl(TmsEngine):
    """The saver's state (see the module docstring); ``binary``: the C side (default: this process's library)."""

    def __init__(self, hook_mode: str = "preload", *, binary: BinaryWrapper | None = None, **kwargs: Any) -> None:
        self._binary_wrapper = binary if binary is not None else process_wrapper()
        self._py: dict[str, Any] = {"retain": False, "dir": "/tmp", "margin": 0, "backend": "pinned"}  # noqa: S108
        early = self._binary_wrapper.early_context() if self._binary_wrapper is not None else None
        if early is not None and kwargs.get("allocator") is None:  # TMS_INIT_ENABLE=1: served from the process start
            kwargs["allocator"] = adopt_context(TaggedAllocator(), early)
        super().__init__(hook_mode, **kwargs)
        self.shadows = ShadowStore.of(self.allocator)
        self.shadows.retain = lambda: self.retain_cpu_backup
        self.shadows.disk_dir = lambda: self.disk_backup_dir
        self.shadows.chunk_bytes = self.settings.disk_chunk_bytes
        self._mem_pools = MemPools(self)
        if self._binary_wrapper is not None:
            self._binary_wrapper.register(self._command, self.cpu_backup_pointer)

    # -- the settings TMS keeps in C --------------------------------------------------------

    @property  # type: ignore[override]
    def retain_cpu_backup(self) -> bool:
        """Whether a resume keeps the CPU backups (``TMS_RETAIN_CPU_BACKUP``; ``tms_get_retain_cpu_backup``)."""
        b = self._binary_wrapper
        return bool(b.cdll.tms_get_retain_cpu_backup()) if b is not None else bool(self._py["retain"])

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        if self._binary_wrapper is not None:
            self._binary_wrapper.cdll.tms_set_retain_cpu_backup(bool(value))
        self._py["retain"] = bool(value)

    @property  # type: ignore[override]
    def disk_backup_dir(self) -> str:
        """Where disk backups go (``TMS_DISK_BACKUP_DIR``, ``set_disk_backup_dir``)."""
        b = self._binary_wrapper
        return b.disk_backup_dir() if b is not None else str(self._py["dir"])

    @disk_backup_dir.setter
    def disk_backup_dir(self, path: str) -> None:
        if self._binary_wrapper is not None:
            self._binary_wrapper.cdll.tms_set_disk_backup_dir(path.encode("utf-8"))
        self._py["dir"] = path

    @property  # type: ignore[override]
    def memory_margin_bytes(self) -> int:
        """Device bytes a raw cudaMalloc must leave free (preload mode; ``set_memory_margin_bytes``)."""
        b = self._binary_wrapper
        return int(b.cdll.tmsp_get_memory_margin_bytes()) if b is not None else int(self._py["margin"])

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        if self._binary_wrapper is not None:
            self._binary_wrapper.cdll.set_memory_margin_bytes(value)
        self._py["margin"] = value

    @property  # type: ignore[override]
    def cpu_backup_backend(self) -> str:
        """This thread's default backend for a region with a CPU backup (``TMS_INIT_CPU_BACKUP_BACKEND``)."""
        b = self._binary_wrapper
        return b.backend() if b is not None else str(self._py["backend"])

    @cpu_backup_backend.setter
    def cpu_backup_backend(self, value: str) -> None:
        self._py["backend"] = value

    # -- regions, in step with the C side ----------------------------------------------------

    def torpor_tag_of(self, tag: str, cpu: bool, disk: bool, backend: str | None) -> str:
        """The torpor tag of a region of ``tag`` with these settings."""
        return self.torpor_tag(tag, mode_of(cpu, disk, backend or self.cpu_backup_backend))

    @contextmanager
    def region(
        self, tag: str, enable_cpu_backup: bool, enable_disk_backup: bool, backend: str | None
    ) -> Iterator[None]:
        """TmsEngine's region, its pool listed in ``_mem_pools`` and its settings set on the C side for the block."""
        resolved = (backend or self.cpu_backup_backend) if enable_cpu_backup else ""
        key: PoolKey = (tag, enable_cpu_backup, enable_disk_backup, resolved, self._device())
        pool = self._mem_pools[key]
        with (
            super().region(tag, enable_cpu_backup, enable_disk_backup, backend),
            self._with_region_config(tag, enable_cpu_backup, backend, enable_disk_backup),
        ):
            yield
        del pool

    @contextmanager
    def _with_region_config(
        self, tag: str, enable_cpu_backup: bool, cpu_backup_backend: str | None, enable_disk_backup: bool = False
    ) -> Iterator[None]:
        """This thread's C-side settings for the block; the outer ones come back on exit (TMS's, by name)."""
        b = self._binary_wrapper
        if b is None:
            yield
            return
        outer = b.config()
        b.set_config(
            tag=tag,
            interesting_region=True,
            enable_cpu_backup=enable_cpu_backup,
            cpu_backup_backend=cpu_backup_backend,
            enable_disk_backup=enable_disk_backup,
        )
        try:
            yield
        finally:
            b.set_config(**outer)

    @contextmanager
    def disable(self) -> Iterator[None]:
        """TmsEngine's disable, the C side's interesting_region off inside (on after, as TMS sets it); its memory given back after.

        TMS allocates inside ``disable()`` from a fresh torch ``MemPool`` that it drops at the end, so what was
        allocated there and freed goes back to the device at exit (slime's weight update runs there).
        """
        b = self._binary_wrapper
        try:
            with super().disable():
                if b is not None:
                    b.cdll.tms_set_interesting_region(False)
                yield
        finally:
            if b is not None:
                b.cdll.tms_set_interesting_region(True)
            self.allocator.empty_cache([DISABLED_TAG])

    def _device(self) -> int:
        if not self.allocator.on_cuda:
            return self.allocator.default_device
        import torch

        return int(torch.cuda.current_device())

    # -- pause, resume, backups --------------------------------------------------------------

    def pause(self, tag: str | None) -> None:
        """TmsEngine's pause, the disk directory checked first when a tag paused keeps a disk backup (nothing released)."""
        for t in self._targets(tag):
            with self._lock:
                modes = self.tags[t].modes
            if DISK in modes and self.allocator.allocations(modes[DISK]):
                self.shadows.check_disk()
        super().pause(tag)

    def _command(self, op: str, tag: str | None) -> None:
        (self.pause if op == "pause" else self.resume)(tag)

    def cpu_backup_pointer(self, address: int, nbytes: int) -> int | None:
        """The host address of the CPU backup of ``[address, address + nbytes)``, None when none is held."""
        return self.shadows.pointer(address, nbytes)

    def pool_dropped(self, torpor_tag: str) -> None:
        """A ``_mem_pools`` entry went: give back its tag's free cached memory, and the backups of what is freed."""
        self.allocator.empty_cache([torpor_tag])
        self.shadows.prune_freed(torpor_tag)

    def close(self) -> None:
        """TmsEngine's close, the backups freed."""
        super().close()
        self.shadows.close()


__all__ = ["MemPools", "PoolRef", "TmsImpl", "adopt_context"]
