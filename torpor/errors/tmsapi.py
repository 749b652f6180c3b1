"""The errors of torpor's torch_memory_saver API (:mod:`torpor.tms`): where TMS prints and calls ``exit(1)``, torpor raises one of these."""

from __future__ import annotations

from collections.abc import Iterable

from torpor.errors.base import TorporError

__all__ = [
    "DiskBackupRefused",
    "TagStateError",
    "TmsArgumentError",
    "TmsBackupMapFailed",
    "TmsConfigError",
    "TmsDiskBackupShort",
    "TmsError",
    "TmsNotProvided",
    "TmsNotReadable",
    "TmsUsageError",
    "TmsWriteOnly",
]


class TmsError(TorporError):
    """Base of the errors :mod:`torpor.tms` raises."""


class TagStateError(TmsError, RuntimeError):
    """``pause`` of a tag that is not awake, or ``resume`` of a tag that is not paused: ``command``, ``tag``, ``state``.

    TMS 0.0.10 prints "Cannot pause allocation that is not active" and exits the
    process; torpor raises, with nothing touched.
    """

    def __init__(self, command: str, tag: str, state: str, allowed: Iterable[str]) -> None:
        self.command = command
        self.tag = tag
        self.state = state
        self.allowed = tuple(allowed)
        verb = "paused" if command == "resume" else "awake"
        hint = "resume it first" if command == "pause" else "pause it first"
        msg = (
            f"torch_memory_saver.{command}: tag {tag!r} is {state!r}, not {verb} "
            f"({command} needs {' or '.join(self.allowed)}); {hint}"
        )
        super().__init__(msg)


class TmsConfigError(TmsError, ValueError):
    """A ``TMS_*`` environment variable (``name``) with a value (``value``) TMS does not accept."""

    def __init__(self, name: str, value: str, accepted: str) -> None:
        self.name = name
        self.value = value
        msg = f"{name}={value!r} is not accepted (TMS exits on it); use {accepted}"
        super().__init__(msg)


class TmsUsageError(TmsError, RuntimeError):
    """A call TMS refuses too (an ``assert`` or an ``exit(1)`` there), said as a torpor error: ``what``."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(what)


class DiskBackupRefused(TmsError, OSError):
    """A pause whose disk backup cannot be written (``directory``, ``reason``): refused before anything is released."""

    def __init__(self, directory: str, reason: str) -> None:
        self.directory = directory
        self.reason = reason
        msg = (
            f"torch_memory_saver.pause refused: the disk backup directory {directory!r} cannot be written ({reason}); "
            "nothing was released. Point TMS_DISK_BACKUP_DIR or set_disk_backup_dir() at a writable directory"
        )
        super().__init__(msg)


class TmsArgumentError(TmsError, ValueError):
    """An argument TMS does not take either (a hook mode, a backup backend, a negative margin)."""


class TmsWriteOnly(TmsError, AttributeError):
    """A read of an attribute TMS makes write-only (``hook_mode``)."""


class TmsNotReadable(TmsError, NotImplementedError):
    """A read of a setting TMS can set but not read (``memory_margin_bytes``), in TMS's own words."""


class TmsBackupMapFailed(TmsError, MemoryError):
    """The host memory of a CPU backup could not be mapped."""


class TmsDiskBackupShort(TmsError, OSError):
    """A disk backup file that holds fewer bytes than its region: it cannot be restored."""


class TmsNotProvided(TmsError, ModuleNotFoundError):
    """A torch_memory_saver module torpor.tms does not provide (the switch is on, the module is not there)."""
