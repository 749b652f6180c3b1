"""torpor.tms.internals: TMS's _impl surface (C settings per region, _mem_pools, retain, mmap and disk backups) on the simulated device."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
from support import RigMaker
from test_tms_binarywrapper import wrapper

from torpor.allocator import TaggedAllocator
from torpor.errors import DiskBackupRefused
from torpor.statemachine.core.states import State
from torpor.tms.envsettings import TmsSettings
from torpor.tms.internals import TmsImpl, adopt_context
from torpor.units import MiB


def engine(make_rig: RigMaker, tmp_path: Path, **settings: object) -> TmsImpl:
    """A torch-mode saver state on a simulated 64 MiB device with its own build of the C library."""
    return TmsImpl(
        "torch",
        binary=wrapper(tmp_path),
        allocator=make_rig("cuda_like", capacity=64 * MiB).allocator,
        settings=TmsSettings(**settings),  # type: ignore[arg-type]
        telemetry=False,
    )


def filled(e: TmsImpl, tag: str, cpu: bool, disk: bool, backend: str | None, byte: int, n: int = 1 << 20) -> int:
    """One allocation of ``n`` bytes of ``byte`` in a region."""
    with e.region(tag, cpu, disk, backend):
        a = e.allocator.allocate(n)
    e.allocator.write(a, bytes([byte]) * n)
    return a


def test_nested_regions_restore_the_outer_settings_in_c(tmp_path: Path, make_rig: RigMaker) -> None:
    """Inside region(tag=g) the C getters say g; leaving it gives back the outer region's tag, backup and backend."""
    e = engine(make_rig, tmp_path)
    c = e._binary_wrapper.cdll  # type: ignore[union-attr]
    with e.region("outer", True, False, "mmap"):
        with e.region("g", False, False, None):
            assert (c.tms_get_current_tag(), c.tms_get_enable_cpu_backup()) == (b"g", False)
        assert (c.tms_get_current_tag(), c.tms_get_enable_cpu_backup(), c.tms_get_cpu_backup_backend()) == (
            b"outer",
            True,
            b"mmap",
        )
    assert (c.tms_get_current_tag(), c.tms_get_cpu_backup_backend()) == (b"default", b"pinned")
    with e.region("outer", True, False, None), e.disable():
        assert not c.tms_get_interesting_region()


def test_tms_pause_from_c_is_a_logged_sleep(tmp_path: Path, make_rig: RigMaker) -> None:
    """tms_pause(NULL) and tms_resume(NULL) through the C library pause and resume every tag, as sleeps and wakes."""
    e = engine(make_rig, tmp_path)
    a = filled(e, "w", True, False, None, 0x5A)
    c = e._binary_wrapper.cdll  # type: ignore[union-attr]
    assert c.tms_pause(None) == 0
    assert e.controllers["w"].state is State.ASLEEP_L1
    assert c.tms_resume(None) == 0
    assert e.allocator.read(a, 4) == b"\x5a" * 4


@pytest.mark.parametrize("backend", ["pinned", "mmap"])
def test_retained_backup_keeps_its_address_and_is_refreshed_in_place(
    tmp_path: Path, backend: str, make_rig: RigMaker
) -> None:
    """With retain, the backup outlives resume at the same address, the next pause rewrites it there, a plain resume frees it."""
    e = engine(make_rig, tmp_path)
    a = filled(e, "w", True, False, backend, 0x11)
    e.pause("w")
    first = e.cpu_backup_pointer(a, 4096)
    assert first is not None and ctypes.string_at(first, 4) == b"\x11" * 4
    e.retain_cpu_backup = True
    e.resume("w")
    assert e.cpu_backup_pointer(a, 4096) == first
    e.allocator.write(a, b"\x22" * 4096)
    e.pause("w")
    assert e.cpu_backup_pointer(a, 4096) == first and ctypes.string_at(first, 4) == b"\x22" * 4
    e.retain_cpu_backup = False
    e.resume("w")
    assert e.cpu_backup_pointer(a, 4096) is None
    assert e.allocator.read(a, 4) == b"\x22" * 4


def test_mmap_backup_goes_back_to_the_os_after_resume(tmp_path: Path, make_rig: RigMaker) -> None:
    """An mmap backup's pages count in RSS while paused and are unmapped by a resume without retain."""
    e = engine(make_rig, tmp_path)
    filled(e, "w", True, False, "mmap", 0x33, 32 << 20)
    e.pause("w")
    held = e.shadows.host_bytes("w")
    e.resume("w")
    assert (held, e.shadows.host_bytes("w")) == (32 << 20, 0)


def test_disk_backup_writes_a_file_per_allocation_and_removes_it_on_resume(tmp_path: Path, make_rig: RigMaker) -> None:
    """A disk-backed tag's pause writes one file per allocation into the directory; resume reads them back and removes them."""
    e = engine(make_rig, tmp_path)
    e.disk_backup_dir = str(tmp_path / "spill")
    e.shadows.chunk_bytes = 1 << 16  # several chunks per file
    a = filled(e, "d", False, True, None, 0x44)
    b = filled(e, "d", False, True, None, 0x45, 8192)
    e.pause("d")
    files = sorted(os.listdir(tmp_path / "spill"))
    assert len(files) == 2 and sum(os.path.getsize(tmp_path / "spill" / f) for f in files) >= (1 << 20) + 8192
    assert e.cpu_backup_pointer(a, 16) is None  # a disk backup has no CPU copy (TMS: None)
    e.resume("d")
    assert os.listdir(tmp_path / "spill") == []
    assert (e.allocator.read(a, 4), e.allocator.read(b, 4)) == (b"\x44" * 4, b"\x45" * 4)


def test_an_unwritable_disk_directory_is_refused_before_anything_is_released(
    tmp_path: Path, make_rig: RigMaker
) -> None:
    """A pause whose disk directory cannot be written raises DiskBackupRefused and every tag stays awake and intact."""
    e = engine(make_rig, tmp_path)
    (tmp_path / "a-file").write_bytes(b"")
    e.disk_backup_dir = str(tmp_path / "a-file" / "spill")  # under a file: no one can make it, root neither
    kept = filled(e, "w", True, False, None, 0x66)
    a = filled(e, "d", False, True, None, 0x55)
    with pytest.raises(DiskBackupRefused, match="cannot be written"):
        e.pause(None)
    assert (e.controllers["d"].state, e.controllers["w"].state) == (State.AWAKE, State.AWAKE)
    assert (e.allocator.read(a, 4), e.allocator.read(kept, 4)) == (b"\x55" * 4, b"\x66" * 4)


def test_dropping_a_mem_pool_frees_the_backups_of_what_it_held(tmp_path: Path, make_rig: RigMaker) -> None:
    """_mem_pools is keyed (tag, cpu, disk, backend, device); freeing the memory and dropping the entry frees its retained backup."""
    e = engine(make_rig, tmp_path)
    a = filled(e, "r", True, False, None, 0x77)
    e.retain_cpu_backup = True
    e.pause("r")
    e.resume("r")
    assert e.cpu_backup_pointer(a, 16) is not None
    ref = e._mem_pools.pop(("r", True, False, "pinned", 0))
    e.allocator.free(a)
    del ref
    assert e.shadows.host_bytes("r") == 0


def test_adopt_context_sees_what_the_table_already_holds(make_rig: RigMaker) -> None:
    """An allocator adopting another table's context sees its allocations under the same tag names."""
    first = make_rig("cuda_like", capacity=64 * MiB).allocator
    with first.use_memory_pool("default"):
        pass
    a = first.allocate(1 << 20, "default")
    second = adopt_context(TaggedAllocator(first.driver), first.native_entry.context)
    assert [x for x, _, _ in second.allocations("default")] == [a]
