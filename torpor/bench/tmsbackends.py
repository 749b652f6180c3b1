"""The backup backends of the torch_memory_saver rows of ``torpor bench --real-model``: pinned, mmap and disk.

Each backend is one pair of rows, torpor.tms then torch_memory_saver, that differ
only in the weights' region: ``region(tag=..., enable_cpu_backup=True,
cpu_backup_backend="pinned" | "mmap")`` or, for ``disk``, ``region(tag=...,
enable_disk_backup=True)`` after ``set_disk_backup_dir`` names a fresh directory
on a real disk (never tmpfs or ramfs: a backup there stays in RAM), removed after
the run. The pinned rows keep the names and the tag of the rows before the
backends ("torpor.tms", "torch_memory_saver", tag ``weights``), so their figures
stay comparable.

Each backend's weights have a tag of their own (``weights``, ``weights-mmap``,
``weights-disk``): in hook mode torch both savers keep each region's torch
``MemPool`` for the process's life, so the segments an earlier row's model
freed stay allocated under its tag (``torch.cuda.empty_cache`` releases no
block of a pool still referenced). Under one shared tag a later row's pause
would also take those stale segments: TMS copies every allocation of the tag,
torpor.tms trims free blocks (and its released bytes would count them).

The host bytes a row reports are what is measured: the process's resident set
(``/proc/self/statm``) while paused and after resume, over its size just before
the pause; for ``disk`` also the backup files' bytes while paused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torpor.errors import BadArgument
from torpor.units import GiB

#: The backends, in the order their rows run.
TMS_BACKENDS: tuple[str, ...] = ("pinned", "mmap", "disk")
#: Where the disk backend's directory is made when the caller names none (FHS: kept across reboots, so on a disk).
DEFAULT_DISK_PARENT = Path("/var/tmp")  # noqa: S108 -- only a parent: each run makes its own folder with mkdtemp
#: The mount table read to tell a real disk from memory.
MOUNTS = Path("/proc/self/mounts")
#: Filesystems that hold their files in RAM: a disk backup there bounds no host memory.
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def _refused(what: str, why: str) -> BadArgument:
    return BadArgument(f"{what} refused: {why}; the backends are {', '.join(TMS_BACKENDS)}")


def check_backends(backends: Sequence[str]) -> tuple[str, ...]:
    """``backends`` as a tuple without repeats, in the given order; an unknown or empty list is refused naming the valid ones."""
    names = tuple(dict.fromkeys(backends))
    unknown = [n for n in names if n not in TMS_BACKENDS]
    if unknown:
        raise _refused(f"torch_memory_saver backend {', '.join(map(repr, unknown))}", "no such backend")
    if not names:
        raise _refused("an empty list of torch_memory_saver backends", "it names none")
    return names


def parse_backends(text: str) -> tuple[str, ...]:
    """``"pinned,mmap"`` as ``("pinned", "mmap")`` (spaces around names ignored), checked by :func:`check_backends`."""
    return check_backends([n.strip() for n in text.split(",") if n.strip()])


def row_name(system: str, backend: str) -> str:
    """The row of ``system`` on ``backend``: the system alone for pinned (the rows before the backends), else ``"system backend"``."""
    check_backends([backend])
    return system if backend == "pinned" else f"{system} {backend}"


def weights_region(backend: str) -> dict[str, Any]:
    """The keyword arguments of the weights' ``region()`` on ``backend`` (TMS 0.0.10's names); its tag is the one paused."""
    check_backends([backend])
    tag = "weights" if backend == "pinned" else f"weights-{backend}"
    if backend == "disk":
        return {"tag": tag, "enable_disk_backup": True}
    return {"tag": tag, "enable_cpu_backup": True, "cpu_backup_backend": backend}


def _unescape(field: str) -> str:
    """A path of the mount table, whose spaces, tabs, newlines and backslashes are octal escapes (``\\040``)."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def filesystem(path: Path) -> str:
    """The type of the filesystem that holds ``path`` (its deepest mount point in :data:`MOUNTS`), ``""`` if none."""
    where = os.path.realpath(path)
    best, kind = "", ""
    for line in MOUNTS.read_text().splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape(fields[1])
        inside = where == point or where.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def disk_parent(path: Path | None = None) -> Path:
    """The folder the disk backend's directory is made in (``path``, default :data:`DEFAULT_DISK_PARENT`), made when missing.

    Refused (:class:`~torpor.errors.BadArgument`) on tmpfs or ramfs: the bench's disk rows would time RAM.
    """
    parent = Path(path) if path is not None else DEFAULT_DISK_PARENT
    kind = filesystem(parent)
    if kind in RAM_FILESYSTEMS:
        msg = (
            f"disk backup folder {str(parent)!r} refused: it is on {kind}, which keeps its files in RAM "
            "(the disk rows would time memory, not a disk); name a folder on a disk (--tms-disk-dir)"
        )
        raise BadArgument(msg)
    parent.mkdir(parents=True, exist_ok=True)
    return parent


@contextmanager
def backup_dir(saver: Any, backend: str, parent: Path | None = None) -> Iterator[Path | None]:
    """For ``disk``: a fresh directory under :func:`disk_parent`, set with ``saver.set_disk_backup_dir``, removed on exit.

    Yields ``None`` for the other backends (the saver is not called).
    """
    if backend != "disk":
        yield None
        return
    path = Path(tempfile.mkdtemp(prefix="torpor-bench-disk-", dir=disk_parent(parent)))
    try:
        saver.set_disk_backup_dir(str(path))
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def rss_bytes() -> int:
    """The process's resident set size in bytes (``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _files(folder: Path) -> tuple[int, int]:
    """How many regular files ``folder`` holds, and their bytes."""
    sizes = [e.stat().st_size for e in os.scandir(folder) if e.is_file(follow_symlinks=False)]
    return len(sizes), sum(sizes)


class HostWatch:
    """The host memory a row holds, as measured: RSS over its size before each pause, and a disk backup's files."""

    def __init__(self, disk: Path | None = None) -> None:
        self.disk = disk
        self.base = 0
        self.paused: list[int] = []  # RSS growth while paused, per cycle
        self.resumed: list[int] = []  # RSS growth after resume, per cycle
        self.disk_paused: list[tuple[int, int]] = []  # (files, bytes) while paused, per cycle
        self.disk_left = 0  # most files left after a resume

    def before_pause(self) -> None:
        """Read RSS just before a pause."""
        self.base = rss_bytes()

    def while_paused(self) -> None:
        """Read RSS (and the disk backup's files) while paused."""
        self.paused.append(rss_bytes() - self.base)
        if self.disk is not None:
            self.disk_paused.append(_files(self.disk))

    def after_resume(self) -> None:
        """Read RSS (and the files left) after the resume."""
        self.resumed.append(rss_bytes() - self.base)
        if self.disk is not None:
            self.disk_left = max(self.disk_left, _files(self.disk)[0])

    def held(self) -> int:
        """The most RSS growth seen while paused (0 when none was measured or it fell)."""
        return max(0, *self.paused) if self.paused else 0

    def note(self) -> str:
        """What was measured, for the row's note."""
        if not self.paused:
            return "host: not measured (no cycle)"
        text = (
            f"host RSS over the pause's start (most of {len(self.paused)} cycles): "
            f"{max(self.paused) / GiB:+.2f} GiB paused, {max(self.resumed, default=0) / GiB:+.2f} GiB after resume"
        )
        if self.disk is not None and self.disk_paused:
            files, nbytes = max(self.disk_paused, key=lambda fb: fb[1])
            text += (
                f"; disk backup {nbytes / GiB:.2f} GiB in {files} file(s) while paused "
                f"({filesystem(self.disk) or 'unknown filesystem'}), {self.disk_left} left after resume"
            )
        return text
