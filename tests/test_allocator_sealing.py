"""Every wake checked (WakeChecks): a sleep seals its backed-up pieces, a wake compares; damage is named, counted and rolled back."""

from __future__ import annotations

import ctypes
import random

import pytest
from prometheus_client import CollectorRegistry
from support import RigMaker, cuda_with_triton

from torpor import State, WakeCheckFailed
from torpor.allocator.squeeze.wakecheck import CHECK_CHUNK
from torpor.statemachine.core.events import TagRestored, WakeFailed
from torpor.telemetry import attach, exposition
from torpor.testrig import fill, intact
from torpor.units import MiB


def flip_backup_byte(rig_allocator: object, address: int) -> int:
    """Flip one bit of the host backup byte holding device ``address``; the host address changed."""
    found = rig_allocator.backups.find(address, 1)  # type: ignore[attr-defined]
    assert found is not None, "no backup holds that byte"
    _, spans = found
    host = spans[0].host
    byte = ctypes.c_uint8.from_address(host)
    byte.value ^= 0x10
    return int(host)


def test_a_wake_is_checked_and_says_how_many_bytes(make_rig: RigMaker) -> None:
    """A sleep and wake of intact bytes: every byte comes back, and the tag_restored event says the bytes checked."""
    rig = make_rig("default", capacity=64 * MiB)
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [3 * CHECK_CHUNK + 4096, CHECK_CHUNK], rng=random.Random(3))
    ctl.sleep(1)
    ctl.wake()
    assert intact(rig.allocator, data)
    restored = [e.data for e in ctl.events() if isinstance(e.data, TagRestored) and e.data.tag == "weights"]
    assert restored and restored[-1].checked == sum(len(b) for b in data.values())


def test_a_byte_flipped_in_the_host_backup_fails_the_wake_by_name_and_the_tag_stays_asleep(
    make_rig: RigMaker,
) -> None:
    """One bit flipped in a backup on the host: the wake raises WakeCheckFailed naming tag, chunk and range, records wake_failed with its class (a failure metric), leaves the tag asleep; put right, the wake restores every byte."""
    rig = make_rig("default", capacity=64 * MiB)
    ctl = rig.control()
    registry = CollectorRegistry()
    telemetry = attach(ctl, registry, otel=False)
    data = fill(rig.allocator, "weights", [4 * CHECK_CHUNK], rng=random.Random(4))
    (address,) = data
    ctl.sleep(1)
    target = address + 2 * CHECK_CHUNK + 777
    host = flip_backup_byte(rig.allocator, target)
    with pytest.raises(WakeCheckFailed) as caught:
        ctl.wake()
    err = caught.value
    assert (err.tag, err.chunk, err.count) == ("weights", 2, 1)
    assert (err.address, err.nbytes) == (address + 2 * CHECK_CHUNK, CHECK_CHUNK)
    assert err.recorded != err.found and "stays asleep" in str(err)
    assert ctl.state is State.ASLEEP_L1
    failed = [e.data for e in ctl.events() if isinstance(e.data, WakeFailed)]
    assert failed and failed[-1].error == "WakeCheckFailed"
    text = exposition(registry).decode()
    assert "torpor_failures_total{" in text and 'error_type="WakeCheckFailed"' in text
    ctypes.c_uint8.from_address(host).value ^= 0x10  # the damage undone: the backup holds the sleep's bytes again
    ctl.wake()
    assert ctl.state is State.AWAKE
    assert intact(rig.allocator, data)
    checked = [
        ln for ln in exposition(registry).decode().splitlines() if ln.startswith("torpor_wake_checked_bytes_total{")
    ]
    assert checked and float(checked[0].split()[-1]) == 4 * CHECK_CHUNK
    telemetry.detach()


def test_with_the_checks_off_a_damaged_backup_wakes_unchecked(
    make_rig: RigMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TORPOR_CHECK_WAKES=0: nothing is sealed or compared, so the wake reports no bytes checked (the damage comes back)."""
    monkeypatch.setenv("TORPOR_CHECK_WAKES", "0")
    rig = make_rig("default", capacity=64 * MiB)
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [CHECK_CHUNK], rng=random.Random(5))
    (address,) = data
    ctl.sleep(1)
    flip_backup_byte(rig.allocator, address + 10)
    ctl.wake()
    restored = [e.data for e in ctl.events() if isinstance(e.data, TagRestored) and e.data.tag == "weights"]
    assert restored[-1].checked == 0
    assert not intact(rig.allocator, data)


@pytest.mark.gpu
def test_on_the_gpu_a_byte_flipped_in_the_host_backup_fails_the_wake_and_the_tag_stays_asleep() -> None:
    """On a GPU: a bit flipped in a pinned backup is WakeCheckFailed naming its chunk, the tag stays asleep; put right, the weights come back bit for bit."""
    torch = cuda_with_triton()
    from torpor import SleepController
    from torpor.allocator import TaggedAllocator

    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("weights"):
        w = torch.randn(8 * CHECK_CHUNK // 2, dtype=torch.bfloat16, device="cuda")
    reference = w.cpu()
    ctl.sleep(1)
    target = w.data_ptr() + 5 * CHECK_CHUNK + 99
    host = flip_backup_byte(alloc, target)
    with pytest.raises(WakeCheckFailed) as caught:
        ctl.wake()
    assert (caught.value.tag, caught.value.count) == ("weights", 1)
    assert caught.value.address <= target < caught.value.address + caught.value.nbytes
    assert ctl.state is State.ASLEEP_L1
    ctypes.c_uint8.from_address(host).value ^= 0x10
    ctl.wake()
    assert torch.equal(w.cpu(), reference)
    ctl.close()
    alloc.close()
