"""Tests of the host-room reading: MemAvailable and cgroup limits from a fake /proc and /sys, claims and their debit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from torpor.allocator.native.headroom import Headroom, host_headroom
from torpor.units import GiB, MiB


def fake_host(root: Path, available_kib: int, cgroup: str = "0::/user.slice/job\n") -> None:
    """A /proc/meminfo, /proc/self/cgroup and an empty cgroup tree under ``root``."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: 999999999 kB\nMemAvailable: {available_kib} kB\n")
    (root / "proc" / "self" / "cgroup").write_text(cgroup)


def limit(root: Path, path: str, max_text: str, current: int, v1: bool = False) -> None:
    """Write a cgroup's limit and usage (v2 names, or v1's)."""
    base = root / "sys" / "fs" / "cgroup" / ("memory" if v1 else "") / path
    base.mkdir(parents=True, exist_ok=True)
    names = ("memory.limit_in_bytes", "memory.usage_in_bytes") if v1 else ("memory.max", "memory.current")
    (base / names[0]).write_text(max_text + "\n")
    (base / names[1]).write_text(f"{current}\n")


def test_free_bytes_is_mem_available_without_cgroup_limits(tmp_path: Path) -> None:
    """With no cgroup limit ('max' or no files) the room is MemAvailable."""
    fake_host(tmp_path, 8 * 1024 * 1024)
    limit(tmp_path, "user.slice", "max", 5 * GiB)
    assert Headroom(str(tmp_path)).free_bytes() == 8 * GiB


def test_the_tightest_cgroup_above_the_process_bounds_the_room(tmp_path: Path) -> None:
    """A parent cgroup's limit - usage counts when it is below MemAvailable and the process's own cgroup."""
    fake_host(tmp_path, 64 * 1024 * 1024)
    limit(tmp_path, "user.slice/job", "max", 30 * GiB)
    limit(tmp_path, "user.slice", str(32 * GiB), 29 * GiB)
    assert Headroom(str(tmp_path)).free_bytes() == 3 * GiB


def test_a_v1_memory_cgroup_limit_counts_and_its_no_limit_value_does_not(tmp_path: Path) -> None:
    """cgroup v1: limit_in_bytes - usage_in_bytes, of the cgroup and its parents; 'unlimited' (a huge number) is no limit."""
    fake_host(tmp_path, 64 * 1024 * 1024, "12:memory:/docker/abc\n3:cpu:/docker/abc\n")
    limit(tmp_path, "docker/abc", str(10 * GiB), 9 * GiB, v1=True)
    assert Headroom(str(tmp_path)).free_bytes() == GiB
    limit(tmp_path, "docker/abc", str(1 << 63), 9 * GiB, v1=True)
    assert Headroom(str(tmp_path)).free_bytes() == 64 * GiB
    limit(tmp_path, "docker", str(12 * GiB), 10 * GiB, v1=True)
    assert Headroom(str(tmp_path)).free_bytes() == 2 * GiB


def test_a_container_that_sees_only_its_own_cgroup_reads_the_mount_root(tmp_path: Path) -> None:
    """The process's cgroup path is absent under the mount (a container's view): the mount root's limit counts."""
    fake_host(tmp_path, 64 * 1024 * 1024, "12:memory:/kubepods/pod1/ctr\n")
    limit(tmp_path, "", str(8 * GiB), 5 * GiB, v1=True)
    assert Headroom(str(tmp_path)).free_bytes() == 3 * GiB


def test_a_usage_over_the_limit_leaves_no_room(tmp_path: Path) -> None:
    """A cgroup using more than its limit (it happens during reclaim) has room 0, not a negative number."""
    fake_host(tmp_path, 64 * 1024 * 1024)
    limit(tmp_path, "user.slice/job", str(GiB), GiB + MiB)
    assert Headroom(str(tmp_path)).free_bytes() == 0


def test_claims_keep_a_margin_and_are_debited_until_the_next_reading(tmp_path: Path) -> None:
    """claim() says yes while the claims leave the margin free, no after, and reads again after ttl."""
    fake_host(tmp_path, 4 * 1024 * 1024)  # 4 GiB available
    room = Headroom(str(tmp_path), ttl=3600, margin=GiB)
    assert room.claim(2 * GiB)
    assert not room.claim(2 * GiB)  # 2 GiB left, 1 GiB of it the margin
    assert room.claim(GiB)
    assert not room.claim(1)
    room.ttl = 0.0
    time.sleep(0.001)
    assert room.claim(2 * GiB)  # read again: 4 GiB available


def test_an_unknown_room_lets_writing_go_on(tmp_path: Path) -> None:
    """No /proc (not Linux, a sandbox): the room is unknown, and claims say yes."""
    room = Headroom(str(tmp_path / "nothing"))
    assert room.free_bytes() is None and room.claim(1 << 50)


def test_this_machine_has_a_reading() -> None:
    """On this Linux machine the process's room is known and positive."""
    free = host_headroom.free_bytes()
    assert free is not None and free > 0


def test_the_first_claim_reads_the_host_whatever_the_machines_uptime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a machine booted 478 s ago (time.monotonic() below ttl) the first claim still reads memory and debits."""
    monkeypatch.setattr(time, "monotonic", lambda: 478.0)
    fake_host(tmp_path, 4 * 1024 * 1024)  # 4 GiB available
    room = Headroom(str(tmp_path), ttl=3600, margin=GiB)
    assert room.claim(2 * GiB)
    assert not room.claim(2 * GiB)  # the reading was taken: 2 GiB left, 1 GiB of it the margin


def test_after_the_first_reading_the_host_is_read_again_only_past_ttl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a fake clock at 100 s: read at the first claim, debits kept within ttl, a new reading past it."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    fake_host(tmp_path, 4 * 1024 * 1024)
    room = Headroom(str(tmp_path), ttl=600, margin=GiB)
    assert room.claim(2 * GiB)
    clock[0] = 650.0
    assert not room.claim(2 * GiB)  # within ttl: the debit holds
    clock[0] = 701.0
    assert room.claim(2 * GiB)  # past ttl: read again, 4 GiB available
