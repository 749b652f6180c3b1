"""Tests for torpor.allocator.sleepwake.undo: a failed release is put back, or released honestly, and never loses a backed-up byte."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
from torpor.errors import AllocatorError
from torpor.testrig import fill, intact, sim_rig

KiB = 1 << 10
G = 16 * KiB


@pytest.fixture
def rig() -> Iterator[tuple[TaggedAllocator, SimDriver, dict[int, bytes]]]:
    """torpor.testrig's rig: an allocator whose tag ``runtime`` has three allocations (three copy batches), each with random bytes."""
    policy = HostPolicy(prepin=True, chunk_bytes=128 * KiB, threads=1)
    with sim_rig(8 << 20, granularity=G, reuse_host=True, host=policy, group_bytes=G) as made:
        blocks = fill(made.allocator, "runtime", [4 * G, 2 * G, 3 * G], rng=random.Random(7))
        made.allocator.wait_host_ready(30)
        yield made.allocator, made.driver, blocks


def test_a_release_whose_map_back_fails_releases_the_tag_and_keeps_every_byte(rig) -> None:  # type: ignore[no-untyped-def]
    """Unmap fails, then the map back fails: the error never says resident, the tag is released, a restore brings every byte."""
    allocator, driver, blocks = rig
    allocator.backup(["runtime"])
    driver.fail("unmap", nth=2)
    driver.fail("create", nth=1)
    with pytest.raises(AllocatorError) as info:
        allocator.release(["runtime"])
    assert "left resident" not in str(info.value)
    assert "released instead" in str(info.value)
    usage = allocator.usage()["runtime"]
    assert (usage.resident, usage.host) == (0, 9 * G)
    allocator.restore(["runtime"])
    assert intact(allocator, blocks)
    allocator.drop_backup(["runtime"])
    allocator.free(allocator.allocate(4096, "runtime"))  # the tag takes allocations again


def test_a_release_whose_copy_and_map_back_fail_copies_the_stale_batch_again(rig) -> None:  # type: ignore[no-untyped-def]
    """A batch's copy fails (it stays mapped), then the map back fails: that batch is copied again before the tag is released."""
    allocator, driver, blocks = rig
    allocator.backup(["runtime"])
    driver.fail("wait", nth=2)
    driver.fail("create", nth=1)
    with pytest.raises(AllocatorError, match="released instead"):
        allocator.release(["runtime"])
    assert allocator.usage()["runtime"].resident == 0
    allocator.restore(["runtime"])
    assert intact(allocator, blocks)


def test_a_release_that_can_be_neither_undone_nor_completed_is_partly_released_then_healed(rig) -> None:  # type: ignore[no-untyped-def]
    """Three faults: the tag is partly released (not resident in usage), backup and drop_backup refuse, restore heals every byte."""
    allocator, driver, blocks = rig
    allocator.backup(["runtime"])
    driver.fail("wait", nth=2)  # batch 2's copy fails: only the device holds it
    driver.fail("create", nth=1)  # mapping batch 1 back fails
    driver.fail("copy_d2h", nth=1)  # and copying batch 2 again fails
    with pytest.raises(AllocatorError, match="partly released"):
        allocator.release(["runtime"])
    usage = allocator.usage()["runtime"]
    assert usage.resident == 0 and usage.host == 9 * G
    with pytest.raises(AllocatorError, match="partly released"):
        allocator.backup(["runtime"])
    with pytest.raises(AllocatorError, match="partly released"):
        allocator.drop_backup(["runtime"])
    allocator.restore(["runtime"])
    assert allocator.usage()["runtime"].resident == 9 * G
    assert intact(allocator, blocks)
    allocator.drop_backup(["runtime"])
    allocator.free(allocator.allocate(4096, "runtime"))


def test_a_map_back_that_fails_half_way_copies_the_backup_into_what_it_mapped_when_it_heals(rig) -> None:  # type: ignore[no-untyped-def]
    """Partly released after mapping one range back fresh: the heal copies the backup into that range too, not only the rest."""
    allocator, driver, blocks = rig
    allocator.backup(["runtime"])
    driver.fail("wait", nth=3)  # batch 3 stays mapped, its copy failed
    driver.fail("create", nth=2)  # batch 1 maps back fresh, batch 2 does not
    driver.fail("copy_d2h", nth=1)  # copying batch 3 again fails: partly released
    with pytest.raises(AllocatorError, match="partly released"):
        allocator.release(["runtime"])
    allocator.restore(["runtime"])
    assert intact(allocator, blocks)
