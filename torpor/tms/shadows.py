"""TMS's host backups of a paused tag, one per allocation: ``pinned``, ``mmap`` (given back to the OS at resume), or ``disk``.

Why not the allocator's own backup: TMS's users hold on to a backup's address
(``get_cpu_backup(x, zero_copy=True)`` kept across a resume with
``retain_cpu_backup``, refreshed in place by the next pause), ask CUDA about it
(``cudaHostGetFlags`` of a pinned one), count on an mmap backup's pages going
back to the OS after a resume, and on a disk backup being one file per
allocation, written at pause, read and removed at resume. So each allocation
of a torpor tag in one of these modes gets its own copy here, made and read
through the allocator's driver; the allocator releases and maps such a tag as
it does a discarded one (mechanism), and the tag's controller decides when (a
pause is its sleep, a resume its wake: :class:`~torpor.tms.tagview.TagView`).
"""

from __future__ import annotations

import ctypes
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import ClassVar

from torpor.allocator import TaggedAllocator, WakeChecks, libc
from torpor.errors import DiskBackupRefused, TmsBackupMapFailed, TmsDiskBackupShort

PINNED, MMAP, DISK = "pinned", "mmap", "disk"
MODES = (PINNED, MMAP, DISK)
_PROT_RW, _MAP_ANON_PRIVATE, _FAILED = 0x3, 0x22, (1 << 64) - 1
_MADV_DONTNEED = 4


@dataclass
class Shadow:
    """The host copy of one allocation: where it lives (``host`` address, or the file ``path`` of a disk one)."""

    address: int
    size: int
    device: int
    kind: str
    host: int = 0
    path: str | None = None


def _mmap(nbytes: int) -> int:
    host = libc().mmap(None, nbytes, _PROT_RW, _MAP_ANON_PRIVATE, -1, 0)
    if host in (None, _FAILED):
        msg = f"mmap of {nbytes} bytes for a CPU backup failed (errno {ctypes.get_errno()})"
        raise TmsBackupMapFailed(msg)
    return int(host)


class ShadowStore:
    """The shadows of one allocator's tags; ``retain``, ``disk_dir`` and ``chunk_bytes`` are the saver's settings."""

    _stores: ClassVar[weakref.WeakKeyDictionary[TaggedAllocator, ShadowStore]] = weakref.WeakKeyDictionary()
    _stores_lock = threading.Lock()

    @classmethod
    def of(cls, allocator: TaggedAllocator) -> ShadowStore:
        """The store of ``allocator`` (made on first use)."""
        with cls._stores_lock:
            store = cls._stores.get(allocator)
            if store is None:
                store = cls._stores[allocator] = cls(allocator)
            return store

    def __init__(self, allocator: TaggedAllocator) -> None:
        self.allocator = allocator
        self.driver = allocator.driver
        self.retain: Callable[[], bool] = lambda: False
        self.disk_dir: Callable[[], str] = tempfile.gettempdir
        self.chunk_bytes = 256 << 20
        self._cuda = allocator.on_cuda  # CUDA copies to and from pageable memory too
        self._tags: dict[str, dict[int, Shadow]] = {}
        self._sums: dict[str, dict[int, tuple[int, ...]]] = {}  # tag -> allocation -> its chunks' sums at the save
        self.checks = WakeChecks(self.driver)  # every resume checked, as the allocator checks its wakes
        self._lock = threading.RLock()

    # -- pause ------------------------------------------------------------------------------

    def check_disk(self) -> str:
        """The disk backup directory, made if missing and written to once; :class:`DiskBackupRefused` if it cannot be."""
        directory = self.disk_dir()
        try:
            os.makedirs(directory, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".torpor-tms-probe-", dir=directory)
            try:
                os.write(fd, b"\0")
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            raise DiskBackupRefused(directory, exc.strerror or str(exc)) from exc
        return directory

    def save(self, tag: str, mode: str) -> int:
        """Copy every allocation of ``tag`` to its shadow (kept ones refreshed in place); the bytes. All or nothing."""
        live = self.allocator.allocations(tag)
        directory = self.check_disk() if mode == DISK else ""
        with self._lock:
            shadows = self._tags.setdefault(tag, {})
            self.prune(tag, {a for a, _, _ in live})
            for device in {d for _, _, d in live}:
                self.driver.synchronize(device)
            written: list[Shadow] = []
            try:
                for address, size, device in live:
                    old = shadows.get(address)
                    if old is not None and (old.size, old.kind) != (size, mode):
                        self._free(shadows.pop(address))
                        old = None
                    shadow = old or Shadow(address, size, device, mode)
                    if mode == DISK:
                        shadow.path = os.path.join(directory, f"torpor-tms-{os.getpid()}-{_safe(tag)}-{address:x}.bin")
                        written.append(shadow)
                        self._write_file(shadow)
                    else:
                        if not shadow.host:
                            shadow.host = self.driver.host_alloc(size) if mode == PINNED else _mmap(size)
                        self._d2h(shadow.host, address, size, device, mode == PINNED)
                    shadows[address] = shadow
                for device in {d for _, _, d in live}:
                    self.driver.wait(self.driver.record(device))
                sums: dict[int, tuple[int, ...]] = {}
                self.checks.seal_regions(sums, live)  # still mapped: the bytes just copied
                self._sums[tag] = sums
            except OSError as exc:
                self._forget_files(written)
                raise DiskBackupRefused(directory, exc.strerror or str(exc)) from exc
            except BaseException:
                self._forget_files(written)
                raise
        return sum(n for _, n, _ in live)

    def _write_file(self, shadow: Shadow) -> None:
        with self._staging(shadow.size) as (stage, n), open(shadow.path or "", "wb") as out:
            for off in range(0, shadow.size, n):
                m = min(n, shadow.size - off)
                self._d2h(stage, shadow.address + off, m, shadow.device, False)
                self.driver.wait(self.driver.record(shadow.device))
                out.write(memoryview((ctypes.c_char * m).from_address(stage)))

    def _forget_files(self, shadows: Iterable[Shadow]) -> None:
        for shadow in shadows:
            if shadow.path:
                _unlink(shadow.path)
                shadow.path = None

    def _d2h(self, host: int, address: int, n: int, device: int, pinned: bool) -> None:
        if pinned or self._cuda:
            self.driver.copy_d2h(host, address, n, device)
        else:  # the simulated device copies into pinned buffers only: pageable memory is written from here
            ctypes.memmove(host, self.driver.read(address, n), n)

    def _h2d(self, address: int, host: int, n: int, device: int, pinned: bool) -> None:
        if pinned or self._cuda:
            self.driver.copy_h2d(address, host, n, device)
        else:
            self.driver.write(address, ctypes.string_at(host, n))

    # -- resume -----------------------------------------------------------------------------

    def load(self, tag: str) -> tuple[int, int]:
        """Copy each shadow of ``tag`` back to its allocation (mapped again already), wait, and check the bytes.

        Returns the bytes restored and the bytes checked against the sums taken at the save; a
        difference is :class:`~torpor.errors.WakeCheckFailed` (the caller releases the tag again).
        """
        live = self.allocator.allocations(tag)
        with self._lock:
            shadows = self._tags.get(tag, {})
            self.prune(tag, {a for a, _, _ in live})
            done = 0
            loaded = []
            for address, size, device in live:
                shadow = shadows.get(address)
                if shadow is None:
                    continue
                loaded.append((address, size, device))
                if shadow.kind == DISK:
                    self._read_file(shadow)
                else:
                    self._h2d(address, shadow.host, size, device, shadow.kind == PINNED)
                done += size
            for device in {d for _, _, d in live}:
                self.driver.wait(self.driver.record(device))
            checked = self.checks.check_regions(tag, self._sums.get(tag, {}), loaded)
        return done, checked

    def _read_file(self, shadow: Shadow) -> None:
        with self._staging(shadow.size) as (stage, n), open(shadow.path or "", "rb") as src:
            for off in range(0, shadow.size, n):
                m = min(n, shadow.size - off)
                got = src.readinto(memoryview((ctypes.c_char * m).from_address(stage)))
                if got != m:
                    msg = f"disk backup {shadow.path} is short: {off + (got or 0)} of {shadow.size} bytes"
                    raise TmsDiskBackupShort(msg)
                self._h2d(shadow.address + off, stage, m, shadow.device, False)
                self.driver.wait(self.driver.record(shadow.device))

    def drop(self, tag: str) -> None:
        """After a resume: disk files go; CPU shadows go too unless ``retain`` (then kept at the same address)."""
        keep = self.retain()
        with self._lock:
            shadows = self._tags.get(tag, {})
            for address in list(shadows):
                if shadows[address].kind == DISK or not keep:
                    self._free(shadows.pop(address))

    def prune(self, tag: str, alive: Iterable[int]) -> None:
        """Free the shadows of ``tag`` whose allocation is gone (freed since)."""
        keep = set(alive)
        with self._lock:
            shadows = self._tags.get(tag, {})
            for address in [a for a in shadows if a not in keep]:
                self._free(shadows.pop(address))

    def prune_freed(self, tag: str) -> None:
        """Free the shadows of ``tag`` whose allocation the table no longer holds."""
        self.prune(tag, (a for a, _, _ in self.allocator.allocations(tag)))

    def _free(self, shadow: Shadow) -> None:
        if shadow.kind == PINNED and shadow.host:
            self.driver.host_free(shadow.host)
        elif shadow.kind == MMAP and shadow.host:
            libc().munmap(shadow.host, shadow.size)
        elif shadow.path:
            _unlink(shadow.path)
        shadow.host, shadow.path = 0, None

    # -- lookups ----------------------------------------------------------------------------

    def pointer(self, address: int, nbytes: int) -> int | None:
        """The host address of ``[address, address + nbytes)`` in a CPU shadow, None when none holds it."""
        with self._lock:
            for shadows in self._tags.values():
                for shadow in shadows.values():
                    if shadow.host and shadow.address <= address and address + nbytes <= shadow.address + shadow.size:
                        return shadow.host + (address - shadow.address)
        return None

    def files(self, tag: str) -> list[str]:
        """The disk backup files of ``tag`` now."""
        with self._lock:
            return sorted(s.path for s in self._tags.get(tag, {}).values() if s.path)

    def host_bytes(self, tag: str | None = None) -> int:
        """Bytes held in CPU shadows (of ``tag``, or all)."""
        with self._lock:
            groups = self._tags.values() if tag is None else [self._tags.get(tag, {})]
            return sum(s.size for g in groups for s in g.values() if s.host)

    def close(self) -> None:
        """Free every shadow."""
        with self._lock:
            for shadows in self._tags.values():
                for shadow in shadows.values():
                    self._free(shadow)
            self._tags.clear()

    # -- staging ----------------------------------------------------------------------------

    def _staging(self, size: int) -> _Staging:
        return _Staging(min(size, self.chunk_bytes))


class _Staging:
    """A pageable host buffer for a disk backup's chunks, unmapped on exit."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(nbytes, 1)
        self.host = 0

    def __enter__(self) -> tuple[int, int]:
        self.host = _mmap(self.nbytes)
        return self.host, self.nbytes

    def __exit__(self, *exc: object) -> None:
        libc().munmap(self.host, self.nbytes)


def _safe(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", tag) or "_"


def _unlink(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


__all__ = ["DISK", "MMAP", "MODES", "PINNED", "Shadow", "ShadowStore"]
