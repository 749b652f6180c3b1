"""Tests for torpor.allocator.sleepwake.undo: a failed release is put back, or released honestly, and never loses a backed-up byte."""

from __future__ import annotations

import random

import pytest
from support import RigMaker

from torpor.errors import AllocatorError
from torpor.testrig import SimRig, fill, intact
from torpor.units import KiB

G = 16 * KiB


@pytest.fixture
def rig(make_rig: RigMaker) -> SimRig:
    """The rig: 8 MiB of 16 KiB granules, one copy batch per granule, host pinned ahead (the small_batches preset)."""
    return make_rig("small_batches")


@pytest.fixture
def blocks(rig: SimRig) -> dict[int, bytes]:
    """Tag ``runtime``'s three allocations (three copy batches) with random bytes, pinned ahead; address -> bytes."""
    made = fill(rig.allocator, "runtime", [4 * G, 2 * G, 3 * G], rng=random.Random(7))
    rig.allocator.wait_host_ready(30)
    return made


def test_a_release_whose_map_back_fails_releases_the_tag_and_keeps_every_byte(
    rig: SimRig, blocks: dict[int, bytes]
) -> None:
    """Unmap fails, then the map back fails: the error never says resident, the tag is released, a restore brings every byte."""
    rig.allocator.backup(["runtime"])
    rig.driver.fail("unmap", nth=2)
    rig.driver.fail("create", nth=1)
    with pytest.raises(AllocatorError) as info:
        rig.allocator.release(["runtime"])
    assert "left resident" not in str(info.value)
    assert "released instead" in str(info.value)
    usage = rig.allocator.usage()["runtime"]
    assert (usage.resident, usage.host) == (0, 9 * G)
    rig.allocator.restore(["runtime"])
    assert intact(rig.allocator, blocks)
    rig.allocator.drop_backup(["runtime"])
    rig.allocator.free(rig.allocator.allocate(4096, "runtime"))  # the tag takes allocations again


def test_a_release_whose_copy_and_map_back_fail_copies_the_stale_batch_again(
    rig: SimRig, blocks: dict[int, bytes]
) -> None:
    """A batch's copy fails (it stays mapped), then the map back fails: that batch is copied again before the tag is released."""
    rig.allocator.backup(["runtime"])
    rig.driver.fail("wait", nth=2)
    rig.driver.fail("create", nth=1)
    with pytest.raises(AllocatorError, match="released instead"):
        rig.allocator.release(["runtime"])
    assert rig.allocator.usage()["runtime"].resident == 0
    rig.allocator.restore(["runtime"])
    assert intact(rig.allocator, blocks)


def test_a_release_that_can_be_neither_undone_nor_completed_is_partly_released_then_healed(
    rig: SimRig, blocks: dict[int, bytes]
) -> None:
    """Three faults: the tag is partly released (not resident in usage), backup and drop_backup refuse, restore heals every byte."""
    rig.allocator.backup(["runtime"])
    rig.driver.fail("wait", nth=2)  # batch 2's copy fails: only the device holds it
    rig.driver.fail("create", nth=1)  # mapping batch 1 back fails
    rig.driver.fail("copy_d2h", nth=1)  # and copying batch 2 again fails
    with pytest.raises(AllocatorError, match="partly released"):
        rig.allocator.release(["runtime"])
    usage = rig.allocator.usage()["runtime"]
    assert usage.resident == 0 and usage.host == 9 * G
    with pytest.raises(AllocatorError, match="partly released"):
        rig.allocator.backup(["runtime"])
    with pytest.raises(AllocatorError, match="partly released"):
        rig.allocator.drop_backup(["runtime"])
    rig.allocator.restore(["runtime"])
    assert rig.allocator.usage()["runtime"].resident == 9 * G
    assert intact(rig.allocator, blocks)
    rig.allocator.drop_backup(["runtime"])
    rig.allocator.free(rig.allocator.allocate(4096, "runtime"))


def test_a_map_back_that_fails_half_way_copies_the_backup_into_what_it_mapped_when_it_heals(
    rig: SimRig, blocks: dict[int, bytes]
) -> None:
    """Partly released after mapping one range back fresh: the heal copies the backup into that range too, not only the rest."""
    rig.allocator.backup(["runtime"])
    rig.driver.fail("wait", nth=3)  # batch 3 stays mapped, its copy failed
    rig.driver.fail("create", nth=2)  # batch 1 maps back fresh, batch 2 does not
    rig.driver.fail("copy_d2h", nth=1)  # copying batch 3 again fails: partly released
    with pytest.raises(AllocatorError, match="partly released"):
        rig.allocator.release(["runtime"])
    rig.allocator.restore(["runtime"])
    assert intact(rig.allocator, blocks)
