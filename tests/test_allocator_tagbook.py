"""Tests of torpor.allocator.sleepwake.tagbook: each tag's record, usage by residency, and the tag each thread routes to."""

from __future__ import annotations

import threading

import pytest
from support import RigMaker

from torpor.allocator import SimDriver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.tagbook import TagBook
from torpor.testrig import GRANULE as G
from torpor.testrig import SimRig


def book() -> TagBook:
    """A tag book over a native table on a small simulated device."""
    return TagBook(NativeTable(SimDriver(16 * G * 64, granularity=G), 0))


def test_a_tag_is_recorded_once_on_first_use() -> None:
    """state() makes one record per tag and registers the tag with the table."""
    tags = book()
    first = tags.state("weights")
    assert tags.state("weights") is first
    assert "weights" in tags and "kv_cache" not in tags
    assert tags.usage()["weights"].resident == 0


def test_usage_and_tagged_bytes_follow_the_table() -> None:
    """usage() reports resident bytes per tag; tagged_bytes() leaves out the excluded tags."""
    tags = book()
    tags.state("weights")
    tags.state("kv_cache")
    tags.table.alloc("weights", 0, 2 * G)
    tags.table.alloc("kv_cache", 0, 3 * G)
    usage = tags.usage()
    assert (usage["weights"].resident, usage["weights"].allocations) == (2 * G, 1)
    assert tags.tagged_bytes() == 5 * G
    assert tags.tagged_bytes(frozenset({"kv_cache"})) == 2 * G


def test_routing_nests_per_thread_and_unwinds_on_error() -> None:
    """The innermost routed tag wins, another thread sees its own, and an exception pops the tag."""
    tags = book()
    other: list[str | None] = []
    with tags.routed("weights"):
        with tags.routed("kv_cache"):
            assert tags.current() == "kv_cache"
            thread = threading.Thread(target=lambda: other.append(tags.current()))
            thread.start()
            thread.join()
        assert tags.current() == "weights"
        try:
            with tags.routed("runtime"):
                raise KeyError("x")
        except KeyError:
            pass
        assert tags.current() == "weights"
    assert tags.current() is None and other == [None]


# -- the doors: use_memory_pool blocks and sleeps (issue 26) ----------------------------------------------------


def _engine(make_rig: RigMaker) -> SimRig:
    """A rig of 256 MiB whose allocator holds weights and kv_cache (two granules each)."""
    rig = make_rig(capacity=64 * G * 64)
    with rig.allocator.use_memory_pool("weights"):
        rig.allocator.allocate(2 * G)
    with rig.allocator.use_memory_pool("kv_cache"):
        rig.allocator.allocate(2 * G)
    return rig


def test_a_block_of_a_sleeping_tag_is_refused_at_its_start_naming_the_tag_its_state_and_the_sleep(
    make_rig: RigMaker,
) -> None:
    """use_memory_pool of a tag asleep raises TagNotAwake (state 'asleep', the sleep's event) before anything is routed; an awake tag's block still opens."""
    from torpor import TagNotAwake

    rig = _engine(make_rig)
    ctl = rig.control()
    ctl.sleep(1)
    with (
        pytest.raises(
            TagNotAwake, match=r"tag 'weights' is asleep \(sleep level 1, event #\d+ \(sleep_requested\)\)"
        ) as info,
        rig.allocator.use_memory_pool("weights"),
    ):
        pytest.fail("the block must not open")
    assert info.value.tag == "weights" and info.value.state == "asleep"
    assert rig.allocator._book.open_blocks() == []
    ctl.wake(["weights"])
    with rig.allocator.use_memory_pool("weights"):
        rig.allocator.allocate(G)
    with pytest.raises(TagNotAwake, match="kv_cache"), rig.allocator.use_memory_pool("kv_cache"):
        pass


def test_a_sleep_waits_for_a_block_open_in_another_thread_and_refuses_new_ones_meanwhile(make_rig: RigMaker) -> None:
    """A sleep finds a block open in another thread: new blocks of its tags are refused 'going to sleep' while it waits; it goes on once the block ends."""
    from torpor import State, TagNotAwake

    rig = _engine(make_rig)
    ctl = rig.control()
    inside, release, seen = threading.Event(), threading.Event(), []

    def worker() -> None:
        with rig.allocator.use_memory_pool("weights"):
            inside.set()
            release.wait(10)
            rig.allocator.allocate(G)  # still awake: the sleep waits for this block

    def late() -> None:
        try:
            with rig.allocator.use_memory_pool("weights"):
                seen.append("opened")
        except TagNotAwake as exc:
            seen.append(exc.state)
        release.set()

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(10)
    timer = threading.Timer(0.2, late)
    timer.start()
    ctl.sleep(1)
    t.join(10)
    timer.join(10)
    assert seen == ["going to sleep"]
    assert ctl.state is State.ASLEEP_L1
    assert rig.allocator.usage()["weights"].host == 3 * G  # the block's allocation was backed up


def test_a_sleep_refuses_when_a_block_stays_open_past_its_wait_and_touches_nothing(
    monkeypatch: pytest.MonkeyPatch,
    make_rig: RigMaker,
) -> None:
    """A block open in another thread past TORPOR_BLOCK_WAIT: BlocksOpen names the tag and the thread; still awake, no byte moved, blocks open again."""
    from torpor import BlocksOpen, State

    monkeypatch.setenv("TORPOR_BLOCK_WAIT", "0.1")
    rig = _engine(make_rig)
    ctl = rig.control()
    inside, release = threading.Event(), threading.Event()

    def worker() -> None:
        with rig.allocator.use_memory_pool("kv_cache"):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=worker, name="loader")
    t.start()
    inside.wait(10)
    before = rig.allocator.usage()
    with pytest.raises(BlocksOpen, match=r"tag 'kv_cache' in thread 'loader'") as info:
        ctl.sleep(1)
    release.set()
    t.join(10)
    assert info.value.holders == ("tag 'kv_cache' in thread 'loader'",)
    assert ctl.state is State.AWAKE and rig.allocator.usage() == before
    assert ctl.projection.last_kind == "refused"
    with rig.allocator.use_memory_pool("weights"):  # the doors are open again
        pass
    assert ctl.sleep(1).state is State.ASLEEP_L1


def test_a_sleep_from_inside_a_block_of_its_own_tag_is_refused_at_once(make_rig: RigMaker) -> None:
    """ctl.sleep() inside use_memory_pool('weights') in the same thread cannot wait for itself: refused at once, naming the block."""
    import time

    from torpor import BlocksOpen

    rig = _engine(make_rig)
    ctl = rig.control()
    start = time.monotonic()
    with (
        rig.allocator.use_memory_pool("weights"),
        pytest.raises(BlocksOpen, match="this thread is inside a block of 'weights'"),
    ):
        ctl.sleep(1)
    assert time.monotonic() - start < 5


def test_the_block_wait_is_read_from_the_environment_and_bad_values_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TORPOR_BLOCK_WAIT: unset is 10 s, a number of seconds is taken, nan/negative/words are refused with its name."""
    from torpor.statemachine.machine.sleeping import block_wait

    monkeypatch.delenv("TORPOR_BLOCK_WAIT", raising=False)
    assert block_wait() == 10.0
    monkeypatch.setenv("TORPOR_BLOCK_WAIT", "2.5")
    assert block_wait() == 2.5
    for bad in ("nan", "-1", "inf", "soon"):
        monkeypatch.setenv("TORPOR_BLOCK_WAIT", bad)
        with pytest.raises(ValueError, match="TORPOR_BLOCK_WAIT"):
            block_wait()
