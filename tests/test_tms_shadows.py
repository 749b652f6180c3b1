"""torpor.tms's shadows (pinned, mmap and disk CPU backups made outside the allocator): every resume checked."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
from support import RigMaker
from test_tms_internals import engine, filled

from torpor import WakeCheckFailed
from torpor.statemachine.core.states import State
from torpor.tms.internals import TmsImpl

N = 3 << 20


def damage(e: TmsImpl, tmp_path: Path, backend: str, address: int, offset: int) -> None:
    """Flip one bit of the paused backup of the byte at ``address + offset``: in host memory, or in its file."""
    if backend == "disk":
        (path,) = [tmp_path / "spill" / f for f in os.listdir(tmp_path / "spill")]
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x08
        path.write_bytes(bytes(data))
        return
    host = e.cpu_backup_pointer(address, N)
    assert host is not None
    byte = ctypes.c_uint8.from_address(host + offset)
    byte.value ^= 0x08


@pytest.mark.parametrize("backend", ["pinned", "mmap", "disk"])
def test_a_damaged_tms_backup_fails_the_resume_by_name_and_the_tag_stays_paused(
    tmp_path: Path, make_rig: RigMaker, backend: str
) -> None:
    """A bit flipped in a paused tag's pinned, mmap or disk backup: resume raises WakeCheckFailed naming the chunk, the tag stays paused; put right, resume restores every byte."""
    e = engine(make_rig, tmp_path)
    e.disk_backup_dir = str(tmp_path / "spill")
    disk = backend == "disk"
    a = filled(e, "w", not disk, disk, None if disk else backend, 0x5C, N)
    e.pause("w")
    damage(e, tmp_path, backend, a, (1 << 20) + 4242)
    with pytest.raises(WakeCheckFailed) as caught:
        e.resume("w")
    assert (caught.value.tag, caught.value.chunk, caught.value.count) == ("w", 1, 1)
    assert e.controllers["w"].state is State.ASLEEP_L1
    damage(e, tmp_path, backend, a, (1 << 20) + 4242)  # the same bit again: the backup is the pause's bytes
    e.resume("w")
    assert e.controllers["w"].state is State.AWAKE
    assert e.allocator.read(a, N) == b"\x5c" * N


def test_a_resume_of_an_intact_backup_says_the_bytes_it_checked(tmp_path: Path, make_rig: RigMaker) -> None:
    """The resume of an intact mmap backup restores it and its tag_restored event says every byte of the allocation was checked."""
    e = engine(make_rig, tmp_path)
    a = filled(e, "w", True, False, "mmap", 0x21, N)
    e.pause("w")
    e.resume("w")
    assert e.allocator.read(a, 16) == b"\x21" * 16
    restored = [ev.data for ev in e.controllers["w"].events() if ev.kind == "tag_restored"]
    assert restored[-1].checked == e.allocator.size_of(a)  # type: ignore[union-attr]
