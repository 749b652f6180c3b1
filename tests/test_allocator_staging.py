"""Tests of the staged sleep: copies through a pinned ring into host chunks pinned after the sleep, its failures and rollbacks."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

import pytest
from support import RigMaker

from torpor import HostMemoryPolicy, Policy, SleepController, State
from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
from torpor.errors import TorporError
from torpor.testrig import GRANULE as G
from torpor.testrig import fill, intact
from torpor.units import MiB


def stage_threads() -> list[threading.Thread]:
    """The staging threads still alive."""
    return [t for t in threading.enumerate() if t.name.startswith("torpor-stage-")]


def test_a_first_sleep_copies_through_the_ring_and_pins_the_chunks_after_it(make_rig: RigMaker) -> None:
    """The first sleep copies every byte through the ring; its chunks are pinned once the release unmapped; bit-exact."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [3 * G, 5 * G, G, 7 * G])
    ctl.sleep(1)
    assert rig.allocator._stager.copied == 16 * G and not stage_threads() and rig.allocator._host.wait_ready(10)
    log = [c.call for c in rig.driver.calls]
    assert max(i for i, c in enumerate(log) if c == "unmap") < log.index("host_register")  # no driver-lock fight
    calls = [c.call for c in rig.driver.calls if c.call in ("host_alloc", "host_register", "host_copy", "host_free")]
    first_pin = calls.index("host_register")  # the chunks are registered as they are, after the copies
    assert calls[0] == "host_alloc" and calls.count("host_alloc") == 4  # the ring's four slots
    assert calls.count("host_copy") == 16 and calls.count("host_register") == 2  # a copy per slot; two chunks
    assert "host_copy" not in calls[first_pin:] and calls[:first_pin].count("host_free") == 4  # the ring went first
    ctl.wake()
    assert intact(rig.allocator, data)
    assert rig.allocator._host.pinned_bytes() == rig.allocator.pinned_bytes() == 16 * G == rig.driver.host_used
    rig.allocator.close()


def test_a_later_sleep_copies_straight_into_the_pinned_chunks(make_rig: RigMaker) -> None:
    """Once the chunks are pinned, a sleep copies into them directly: no ring, no host copies."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    ctl.sleep(1)
    ctl.wake()
    before = len(rig.driver.calls)
    ctl.sleep(1)
    assert not [c for c in rig.driver.calls[before:] if c.call in ("host_copy", "host_alloc")]
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


def test_staging_off_pins_each_chunk_before_copying_into_it(make_rig: RigMaker) -> None:
    """HostPolicy(staged=False): the sleep pins every chunk and copies into it; nothing goes through a ring."""
    rig = make_rig("staged", host_options={"staged": False})
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [16 * G])
    ctl.sleep(1)
    assert (
        rig.driver.count("host_copy") == 0 == rig.driver.count("host_register") and rig.driver.count("host_alloc") == 2
    )
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


def test_a_failed_copy_out_of_the_ring_fails_the_sleep_and_leaves_everything_resident(make_rig: RigMaker) -> None:
    """A host copy that fails mid-sleep: the sleep is refused naming host_copy, bytes intact, no thread or chunk left."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    rig.driver.fail("host_copy", nth=5)
    with pytest.raises(TorporError, match="host_copy"):
        ctl.sleep(1)
    assert ctl.state is State.AWAKE and intact(rig.allocator, data) and not stage_threads()
    assert (
        rig.allocator._host.wait_ready(10)
        and rig.allocator.pinned_bytes() == 0 == rig.driver.host_used == rig.driver.host_reserved
    )
    ctl.sleep(1)
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


def test_a_ring_that_cannot_be_pinned_falls_back_to_pinning_the_chunks(
    caplog: pytest.LogCaptureFixture, make_rig: RigMaker
) -> None:
    """No slot of the ring can be pinned: the sleep warns, pins the backup's chunks instead and succeeds; bit-exact."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    rig.driver.fail("host_alloc", times=4)  # the four slots
    with caplog.at_level(logging.WARNING, logger="torpor.allocator"):
        ctl.sleep(1)
    assert "pinning the backup instead" in caplog.text and rig.driver.count("host_copy") == 0 and not stage_threads()
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()
    assert rig.driver.host_used == 0 == rig.driver.host_reserved


def test_a_slot_that_cannot_be_pinned_leaves_a_smaller_ring(make_rig: RigMaker) -> None:
    """One slot's pin fails: the sleep still goes through the other slots, bit-exact, and no host memory leaks."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    rig.driver.fail("host_alloc")
    ctl.sleep(1)
    assert rig.allocator._stager.copied == 16 * G and rig.driver.count("host_copy") == 16
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()
    assert rig.driver.host_used == 0 == rig.driver.host_reserved


def test_a_chunk_whose_pin_fails_after_a_staged_sleep_wakes_from_pageable_memory(make_rig: RigMaker) -> None:
    """The background pin of a filled chunk fails: the wake copies from its pageable pages, every byte back."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    rig.driver.fail("host_register")  # the first chunk's pin
    ctl.sleep(1)
    assert rig.allocator._host.wait_ready(10)
    assert rig.allocator._host.pinned_bytes() == 8 * G  # one of two chunks registered
    ctl.wake()
    assert intact(rig.allocator, data)
    ctl.sleep(1)  # the failed chunk stays until its extents come back, and is never handed out again
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()
    assert rig.driver.host_used == 0 == rig.driver.host_reserved


class GatedPins(SimDriver):
    """A SimDriver whose registrations of filled host chunks wait for ``gate`` (the ring's pin does not)."""

    def __init__(self) -> None:
        super().__init__(64 * MiB, granularity=G)
        self.gate = threading.Event()

    def host_register(self, host: int, nbytes: int) -> None:
        self.gate.wait(10)
        super().host_register(host, nbytes)


def test_a_wake_right_after_a_staged_sleep_waits_for_the_chunks_to_be_pinned(make_rig: RigMaker) -> None:
    """A wake while the background pins still run blocks until they are done, then restores every byte."""
    rig = make_rig("staged", driver=GatedPins())
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    ctl.sleep(1)
    assert (
        rig.allocator._host.pinned_bytes() == 0 and rig.allocator.pinned_bytes() == 16 * G
    )  # held, not yet registered
    woke = threading.Event()
    t = threading.Thread(target=lambda: (ctl.wake(), woke.set()))
    t.start()
    time.sleep(0.2)
    assert not woke.is_set()
    rig.driver.gate.set()  # type: ignore[attr-defined]
    t.join(10)
    assert woke.is_set() and ctl.state is State.AWAKE and intact(rig.allocator, data)
    rig.allocator.close()


class InterruptedCopy(SimDriver):
    """A SimDriver whose ``nth`` device-to-host copy raises KeyboardInterrupt (a Ctrl-C mid-sleep)."""

    def __init__(self, nth: int) -> None:
        super().__init__(64 * MiB, granularity=G)
        self.left = nth

    def _copy_d2h(self, host: int, address: int, nbytes: int, device: int) -> None:
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt
        super()._copy_d2h(host, address, nbytes, device)


def test_ctrl_c_in_the_middle_of_a_staged_sleep_rolls_back_and_stops_every_thread(make_rig: RigMaker) -> None:
    """A Ctrl-C between ring copies: the interrupt propagates, the tag stays resident, nothing is left held or running."""
    rig = make_rig("staged", driver=InterruptedCopy(nth=6))
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    with pytest.raises(KeyboardInterrupt):
        ctl.sleep(1)
    assert ctl.state is State.AWAKE and not stage_threads() and intact(rig.allocator, data)
    assert (
        rig.allocator._host.wait_ready(10)
        and rig.allocator.pinned_bytes() == 0 == rig.driver.host_used == rig.driver.host_reserved
    )
    ctl.sleep(1)
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


def test_no_room_for_the_ring_under_the_host_limit_pins_the_chunks_instead(make_rig: RigMaker) -> None:
    """A limit that fits the backup but not the ring: the sleep pins its chunks and stays within the limit."""
    rig = make_rig("staged")
    rig.control()
    ctl = SleepController(rig.allocator, policy=Policy(host=HostMemoryPolicy(budget_bytes=16 * G)))
    assert rig.allocator._host.policy.limit_bytes == 16 * G
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    ctl.sleep(1)
    assert rig.driver.count("host_copy") == 0 and rig.driver.host_used == 16 * G
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


def test_a_staged_sleep_of_two_tags_fills_chunks_both_share(make_rig: RigMaker) -> None:
    """Two tags in one staged sleep: the second takes the rest of the first's chunk; both wake bit-exact."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = {**fill(rig.allocator, "weights", [5 * G]), **fill(rig.allocator, "cudagraph", [7 * G])}
    ctl.sleep(1)
    assert rig.allocator._stager.copied == 12 * G
    ctl.wake()
    assert intact(rig.allocator, data)
    assert rig.allocator._host.pinned_bytes() == 16 * G == rig.driver.host_used  # two chunks: 8 + 8 granules, shared
    rig.allocator.close()


@pytest.mark.gpu
def test_a_first_sleep_on_the_gpu_stages_and_wakes_bit_exact_at_once() -> None:
    """On a GPU the first sleep goes through the ring; a wake right after it is bit-exact; the next sleep is direct."""
    import torch

    alloc = TaggedAllocator()
    ctl = SleepController(alloc)
    with alloc.use_memory_pool("weights"):
        ts = [torch.randint(0, 255, (64 * MiB,), dtype=torch.uint8, device="cuda") for _ in range(16)]
    refs = [t.cpu() for t in ts]
    torch.cuda.synchronize()
    ctl.sleep(1)
    assert alloc._stager.copied >= 1024 * MiB and not stage_threads()
    ctl.wake()  # the chunks may still be registering: the wake waits for each one it copies from
    assert all(bool(torch.equal(t.cpu(), r)) for t, r in zip(ts, refs, strict=True))
    assert alloc._host.wait_ready(60) and alloc._host.pinned_bytes() == alloc.pinned_bytes() >= 1024 * MiB
    copied = alloc._stager.copied
    for t in ts:
        t.add_(1)
    torch.cuda.synchronize()
    ctl.sleep(1)
    assert alloc._stager.copied == copied  # straight into the pinned chunks
    ctl.wake()
    assert all(bool(torch.equal(t.cpu(), r + 1)) for t, r in zip(ts, refs, strict=True))
    del ts
    alloc.close()


class ZeroingPins(SimDriver):
    """A SimDriver whose pins write zeros first, as populating does on kernels before 5.14 (no MADV_POPULATE_WRITE)."""

    def _host_alloc(self, nbytes: int, host: int | None) -> int:
        address = super()._host_alloc(nbytes, host)
        ctypes.memset(address, 0, nbytes)
        return address


def test_pinning_the_chunks_after_a_staged_sleep_never_writes_over_the_backup(make_rig: RigMaker) -> None:
    """The filled chunks are registered as they are (host_register), not populated: a zeroing pin loses no byte."""
    rig = make_rig("staged", driver=ZeroingPins(64 * MiB, granularity=G))
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    ctl.sleep(1)
    assert rig.allocator._host.wait_ready(10) and rig.driver.count("host_register") == 2
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


def test_small_copies_share_a_slot_with_one_event_per_slot(make_rig: RigMaker) -> None:
    """Sixteen one-granule allocations through four-granule slots: four slot events, sixteen host copies, bit-exact."""
    rig = make_rig("staged", host_options={"stage_slot_bytes": 4 * G, "stage_ring_bytes": 8 * G})
    ctl = rig.control()
    every = fill(rig.allocator, "weights", [G] * 32)
    for a in list(every)[1::2]:  # gaps between the live ones: sixteen separate copies
        rig.allocator.free(a)
    data = {a: b for i, (a, b) in enumerate(every.items()) if i % 2 == 0}
    ctl.sleep(1)
    log = [c.call for c in rig.driver.calls]
    ring = log.index("host_alloc")
    during = log[ring : log.index("host_free", ring)]
    assert during.count("host_copy") == 16
    assert during.count("record") == 4 + 1  # one per slot, and the backup's one batch (64 MiB groups)
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


def test_torpor_staged_sleep_0_turns_staging_off_by_default(
    monkeypatch: pytest.MonkeyPatch, make_rig: RigMaker
) -> None:
    """TORPOR_STAGED_SLEEP=0 makes HostPolicy's default unstaged: the first sleep pins its chunks, no ring."""
    monkeypatch.setenv("TORPOR_STAGED_SLEEP", "0")
    assert HostPolicy().staged is False
    rig = make_rig(host=HostPolicy(chunk_bytes=8 * G), slab_bytes=0)
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G])
    ctl.sleep(1)
    assert rig.driver.count("host_copy") == 0 == rig.driver.count("host_register")
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()
    monkeypatch.setenv("TORPOR_STAGED_SLEEP", "1")
    assert HostPolicy().staged is True


@pytest.mark.parametrize("typo", ["maybe", "of", "2", "yes please"])
def test_torpor_staged_sleep_is_read_as_every_switch_and_a_typo_is_refused(
    monkeypatch: pytest.MonkeyPatch, typo: str
) -> None:
    """TORPOR_STAGED_SLEEP is read by torpor.switches.env_switch: off/false/0 turn staging off, a typo is a ValueError naming it (it read as on)."""
    for off in ("off", "FALSE", " 0 "):
        monkeypatch.setenv("TORPOR_STAGED_SLEEP", off)
        assert HostPolicy().staged is False
    for on in ("on", "true", ""):
        monkeypatch.setenv("TORPOR_STAGED_SLEEP", on)
        assert HostPolicy().staged is True
    monkeypatch.setenv("TORPOR_STAGED_SLEEP", typo)
    with pytest.raises(ValueError, match=r"TORPOR_STAGED_SLEEP=.* is not a switch"):
        HostPolicy()


def test_a_first_sleep_pins_its_chunks_when_the_host_has_no_clear_room_for_writing(make_rig: RigMaker) -> None:
    """Without clear host room a cold sleep does not stage (writes could wake the OOM killer); it pins, bit-exact."""
    rig = make_rig("staged")
    ctl = rig.control()
    asked: list[int] = []

    def no_room(nbytes: int) -> bool:
        asked.append(nbytes)
        return False

    rig.driver.host_room = no_room  # type: ignore[method-assign]
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    ctl.sleep(1)
    calls = [c.call for c in rig.driver.calls]
    assert asked and asked[0] >= 16 * G  # the chunks' bytes (and the ring's) were asked for
    assert "host_copy" not in calls and "host_register" not in calls and calls.count("host_alloc") == 2
    assert rig.allocator._stager.copied == 0
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


def test_a_slot_whose_event_cannot_be_recorded_is_not_unpinned_before_the_stream_is_synchronized(
    make_rig: RigMaker,
) -> None:
    """A failed event record fails the sleep; the ring is unpinned only after the copy stream is synchronized."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    rig.driver.fail("record", nth=2)  # the second slot's event
    with pytest.raises(TorporError):
        ctl.sleep(1)
    assert ctl.state is State.AWAKE and intact(rig.allocator, data) and not stage_threads()
    calls = [c.call for c in rig.driver.calls]
    failed = next(i for i, c in enumerate(rig.driver.calls) if c.call == "record" and c.failed)
    frees = [i for i, c in enumerate(calls) if c == "host_free" and i > failed]
    assert frees and "synchronize" in calls[failed : frees[0]]
    rig.allocator.close()


def test_a_ring_whose_copies_cannot_be_waited_for_stays_pinned(
    caplog: pytest.LogCaptureFixture, make_rig: RigMaker
) -> None:
    """A failed event and a failed synchronize: the ring's slots are leaked (logged), never unpinned under a copy."""
    rig = make_rig("staged")
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    rig.driver.fail("record", nth=2)
    rig.driver.fail("synchronize", nth=2)  # the first is the sleep's own, before its copies
    with caplog.at_level(logging.ERROR, logger="torpor.allocator"), pytest.raises(TorporError):
        ctl.sleep(1)
    assert "stay pinned" in caplog.text and ctl.state is State.AWAKE and intact(rig.allocator, data)
    assert rig.driver.count("host_free") == 0 and not stage_threads()
    rig.allocator.close()


class Fatal(BaseException):
    """Not an Exception: what a thread's bare ``except Exception`` lets through (SystemExit and the like)."""


class FatalIn(SimDriver):
    """A SimDriver whose staging threads hit a BaseException in ``prepare_thread`` or in pinning a slot."""

    def __init__(self, where: str) -> None:
        super().__init__(64 * MiB, granularity=G)
        self.where = where

    def prepare_thread(self) -> None:
        if self.where == "prepare_thread" and threading.current_thread().name.startswith("torpor-stage-"):
            raise Fatal("prepare_thread")

    def _host_alloc(self, nbytes: int, host: int | None) -> int:
        if self.where == "host_alloc" and threading.current_thread().name.startswith("torpor-stage-"):
            raise Fatal("host_alloc")
        return super()._host_alloc(nbytes, host)


def sleep_outcome(ctl: SleepController, timeout: float) -> list[BaseException | str | None]:
    """Sleep at level 1 in a thread: [None] when it went, [the exception] it raised, or ["hung"] after ``timeout`` s."""
    outcome: list[BaseException | str | None] = []

    def sleep() -> None:
        try:
            ctl.sleep(1)
            outcome.append(None)
        except BaseException as exc:  # the outcome is what the test checks
            outcome.append(exc)

    t = threading.Thread(target=sleep, daemon=True)
    t.start()
    t.join(timeout)
    return outcome if not t.is_alive() else ["hung"]


@pytest.mark.parametrize("where", ["prepare_thread", "host_alloc"])
def test_a_staging_thread_that_hits_a_base_exception_fails_the_sleep_instead_of_hanging_it(
    where: str, make_rig: RigMaker
) -> None:
    """A BaseException in a staging thread's setup or slot pin reaches the sleep (refused, resident); it never hangs."""
    sim = FatalIn(where)
    rig = make_rig("staged", driver=sim)
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    outcome = sleep_outcome(ctl, 10)
    assert outcome != ["hung"], "the sleep waits forever for a staging thread that died"
    assert outcome and isinstance(outcome[0], TorporError) and where in str(outcome[0])
    assert ctl.state is State.AWAKE and intact(rig.allocator, data) and not stage_threads()
    sim.where = ""
    ctl.sleep(1)
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()


class FatalPin(SimDriver):
    """A SimDriver whose pinning threads (not the main thread) hit a BaseException when they pin a chunk."""

    def __init__(self) -> None:
        super().__init__(64 * MiB, granularity=G)
        self.armed = True

    def _host_alloc(self, nbytes: int, host: int | None) -> int:
        if self.armed and threading.current_thread() is not threading.main_thread():
            raise Fatal("host_alloc in a pinning thread")
        return super()._host_alloc(nbytes, host)


@pytest.mark.parametrize("prepin", [False, True])
def test_a_pinning_thread_that_hits_a_base_exception_fails_the_sleep_instead_of_hanging_it(
    prepin: bool, make_rig: RigMaker
) -> None:
    """Unstaged pins (a sleep's own threads, or pinning ahead) that hit a BaseException reach the sleep as a torpor error; it never hangs."""
    sim = FatalPin()
    rig = make_rig("staged", driver=sim, host_options={"staged": False, "prepin": prepin})
    ctl = rig.control()
    data = fill(rig.allocator, "weights", [8 * G, 8 * G])
    outcome = sleep_outcome(ctl, 15)
    assert outcome != ["hung"], "the sleep waits forever for a pinning thread that died"
    assert outcome and isinstance(outcome[0], TorporError) and "host_alloc" in str(outcome[0]), outcome
    assert ctl.state is State.AWAKE and intact(rig.allocator, data)
    sim.armed = False
    ctl.sleep(1)
    ctl.wake()
    assert intact(rig.allocator, data)
    rig.allocator.close()
