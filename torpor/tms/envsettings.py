"""The ``TMS_*`` environment, read exactly as torch_memory_saver 0.0.10 reads it (its ``get_bool_env_var`` and friends).

Booleans: unset is false; ``1 true TRUE yes YES`` are true, ``0 false FALSE no
NO`` false, anything else (the empty string too) is refused, where TMS exits
the process. ``TMS_INIT_CPU_BACKUP_BACKEND``: unset or empty is ``pinned``,
else ``mmap`` or ``pinned``. ``TMS_DISK_BACKUP_DIR``: default ``/tmp``.
``TMS_DISK_BACKUP_CHUNK_MB``: ``strtoull`` of it (leading digits), 0 or
unparsable meaning 256.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from torpor.errors import TmsConfigError
from torpor.units import MiB

CpuBackupBackend = Literal["mmap", "pinned"]

INIT_ENABLE = "TMS_INIT_ENABLE"
INIT_ENABLE_CPU_BACKUP = "TMS_INIT_ENABLE_CPU_BACKUP"
INIT_ENABLE_DISK_BACKUP = "TMS_INIT_ENABLE_DISK_BACKUP"
INIT_CPU_BACKUP_BACKEND = "TMS_INIT_CPU_BACKUP_BACKEND"
RETAIN_CPU_BACKUP = "TMS_RETAIN_CPU_BACKUP"
DISK_BACKUP_DIR = "TMS_DISK_BACKUP_DIR"
DISK_BACKUP_CHUNK_MB = "TMS_DISK_BACKUP_CHUNK_MB"

TRUE_VALUES = ("1", "true", "TRUE", "yes", "YES")
FALSE_VALUES = ("0", "false", "FALSE", "no", "NO")
BACKENDS: tuple[CpuBackupBackend, ...] = ("mmap", "pinned")
DEFAULT_BACKEND: CpuBackupBackend = "pinned"
DEFAULT_DISK_DIR = "/tmp"  # noqa: S108 -- TMS's own default, kept as it is
DEFAULT_CHUNK_MB = 256


def parse_bool(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """``name`` as TMS's ``get_bool_env_var`` reads it; :class:`TmsConfigError` where TMS exits."""
    env = os.environ if environ is None else environ
    value = env.get(name)
    if value is None:
        return False
    if value in TRUE_VALUES:
        return True
    if value in FALSE_VALUES:
        return False
    raise TmsConfigError(name, value, f"one of {' '.join(TRUE_VALUES)} or {' '.join(FALSE_VALUES)}")


def parse_backend(name: str, value: str | None) -> CpuBackupBackend:
    """A CPU backup backend: None or empty is ``pinned``; else ``mmap`` or ``pinned``."""
    if not value:
        return DEFAULT_BACKEND
    if value == "mmap":
        return "mmap"
    if value == "pinned":
        return "pinned"
    raise TmsConfigError(name, value, "mmap or pinned")


def parse_chunk_bytes(value: str | None) -> int:
    """``TMS_DISK_BACKUP_CHUNK_MB`` as TMS reads it (``strtoull``; 0 or no digits: 256) in bytes."""
    match = re.match(r"\s*\+?([0-9]+)", value or "")
    mb = int(match.group(1)) if match else 0
    return (mb or DEFAULT_CHUNK_MB) * MiB


@dataclass(frozen=True)
class TmsSettings:
    """What a process's ``TMS_*`` environment says, read once when the saver starts."""

    init_enable: bool = False
    init_enable_cpu_backup: bool = False
    init_enable_disk_backup: bool = False
    cpu_backup_backend: CpuBackupBackend = DEFAULT_BACKEND
    retain_cpu_backup: bool = False
    disk_backup_dir: str = DEFAULT_DISK_DIR
    disk_chunk_bytes: int = DEFAULT_CHUNK_MB * MiB

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TmsSettings:
        """Read every ``TMS_*`` variable of ``environ`` (default ``os.environ``); :class:`TmsConfigError` on a bad one."""
        env = os.environ if environ is None else environ
        return cls(
            init_enable=parse_bool(INIT_ENABLE, env),
            init_enable_cpu_backup=parse_bool(INIT_ENABLE_CPU_BACKUP, env),
            init_enable_disk_backup=parse_bool(INIT_ENABLE_DISK_BACKUP, env),
            cpu_backup_backend=parse_backend(INIT_CPU_BACKUP_BACKEND, env.get(INIT_CPU_BACKUP_BACKEND)),
            retain_cpu_backup=parse_bool(RETAIN_CPU_BACKUP, env),
            disk_backup_dir=env.get(DISK_BACKUP_DIR, DEFAULT_DISK_DIR),
            disk_chunk_bytes=parse_chunk_bytes(env.get(DISK_BACKUP_CHUNK_MB)),
        )
