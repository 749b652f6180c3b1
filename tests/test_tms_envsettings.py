"""The TMS_* environment, read as torch_memory_saver 0.0.10 reads it."""

from __future__ import annotations

import pytest

from torpor.errors import TmsConfigError
from torpor.tms.envsettings import MiB, TmsSettings, parse_backend, parse_bool, parse_chunk_bytes


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", "YES"])
def test_true_spellings(value: str) -> None:
    """Exactly TMS's five true spellings are true."""
    assert parse_bool("TMS_INIT_ENABLE", {"TMS_INIT_ENABLE": value}) is True


@pytest.mark.parametrize("value", ["0", "false", "FALSE", "no", "NO"])
def test_false_spellings(value: str) -> None:
    """Exactly TMS's five false spellings are false."""
    assert parse_bool("TMS_INIT_ENABLE", {"TMS_INIT_ENABLE": value}) is False


def test_unset_is_false() -> None:
    """An unset boolean is false."""
    assert parse_bool("TMS_INIT_ENABLE", {}) is False


@pytest.mark.parametrize("value", ["", "True", "on", "2", " 1", "Yes"])
def test_other_values_are_refused(value: str) -> None:
    """What TMS exits on (the empty string, True, on...) is a TmsConfigError naming the variable and value."""
    with pytest.raises(TmsConfigError, match="TMS_RETAIN_CPU_BACKUP") as info:
        parse_bool("TMS_RETAIN_CPU_BACKUP", {"TMS_RETAIN_CPU_BACKUP": value})
    assert info.value.value == value


def test_backend() -> None:
    """The backend: unset or empty is pinned, mmap and pinned as given, anything else refused."""
    assert parse_backend("X", None) == "pinned"
    assert parse_backend("X", "") == "pinned"
    assert parse_backend("X", "mmap") == "mmap"
    assert parse_backend("X", "pinned") == "pinned"
    with pytest.raises(TmsConfigError, match="mmap or pinned"):
        parse_backend("X", "MMAP")


@pytest.mark.parametrize(
    ("value", "mb"), [(None, 256), ("", 256), ("0", 256), ("abc", 256), ("64", 64), ("12abc", 12), (" 8", 8)]
)
def test_chunk_mb_as_strtoull(value: str | None, mb: int) -> None:
    """TMS_DISK_BACKUP_CHUNK_MB is read as strtoull reads it; 0 or no digits mean 256."""
    assert parse_chunk_bytes(value) == mb * MiB


def test_settings_from_env() -> None:
    """Every variable lands in its field; the defaults are TMS's."""
    assert TmsSettings.from_env({}) == TmsSettings()
    assert TmsSettings().disk_backup_dir == "/tmp"
    env = {
        "TMS_INIT_ENABLE": "1",
        "TMS_INIT_ENABLE_CPU_BACKUP": "yes",
        "TMS_INIT_ENABLE_DISK_BACKUP": "NO",
        "TMS_INIT_CPU_BACKUP_BACKEND": "mmap",
        "TMS_RETAIN_CPU_BACKUP": "true",
        "TMS_DISK_BACKUP_DIR": "/var/tmp/tms",
        "TMS_DISK_BACKUP_CHUNK_MB": "32",
    }
    s = TmsSettings.from_env(env)
    assert (s.init_enable, s.init_enable_cpu_backup, s.init_enable_disk_backup) == (True, True, False)
    assert (s.cpu_backup_backend, s.retain_cpu_backup) == ("mmap", True)
    assert (s.disk_backup_dir, s.disk_chunk_bytes) == ("/var/tmp/tms", 32 * MiB)
