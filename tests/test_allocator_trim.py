"""Tests of per-block pools (BlockPools): idle pools' free segments trimmed, untrimmed when a block reuses the pool."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from torpor.allocator import AllocatorError
from torpor.allocator.torchside.trim import BlockPools, trim_enabled
from torpor.units import MiB


class FakePool:
    """A torch MemPool stand-in: segments (address -> live bytes)."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.segments: dict[int, int] = {}


class Harness:
    """BlockPools over fake pools: records trims and untrims, hands out segment addresses."""

    def __init__(self) -> None:
        self.trims: list[int] = []
        self.untrims: list[int] = []
        self.refuse_untrim = False
        self.asleep = False
        self.made = 0
        self.next_address = 0x1000_0000
        self.queued = 0  # kernels queued on the segments' stream so far
        self.completed = 0  # of which the device has run
        self.marks: list[set[tuple[int, int]]] = []
        self.pending: dict[int, int] = {}  # address -> stream, as the native table keeps them (tp_pend)
        self.reclaimed: set[int] = set()  # trimmed by an allocation under pressure while pending
        self.device_free = 1 << 50  # free device bytes the pools see
        self.blocks = BlockPools(
            self.new_pool,
            self.trim,
            self.untrim,
            self.snapshot,
            mark=self.mark,
            done=self.done,
            pend=self.pend,
            unpend=self.unpend,
            free_bytes=lambda device: self.device_free,
        )

    def pend(self, address: int, stream: int) -> bool:
        self.pending[address] = stream
        return True

    def unpend(self, address: int) -> bool:
        self.pending.pop(address, None)
        if address in self.reclaimed:
            self.reclaimed.discard(address)
            return True
        return False

    def pressure(self) -> None:
        """An allocation out of memory reclaims every pending segment (the table waits for their streams)."""
        self.reclaimed |= set(self.pending)
        self.pending.clear()

    def mark(self, streams: set[tuple[int, int]]) -> object:
        self.marks.append(streams)
        return self.queued

    def done(self, token: object) -> bool:
        return isinstance(token, int) and self.completed >= token

    def kernel(self) -> None:
        """A kernel queued on the stream (not run yet)."""
        self.queued += 1

    def drain(self) -> None:
        """The device ran everything queued."""
        self.completed = self.queued

    def new_pool(self, tag: str) -> FakePool:
        self.made += 1
        return FakePool(self.made)

    def trim(self, address: int) -> bool:
        self.pending.pop(address, None)
        if address in self.reclaimed:  # as tp_trim: a reclaimed segment is reported trimmed once
            self.reclaimed.discard(address)
            return True
        if self.asleep:  # as the table: a sleeping tag's segments are the sleep's to release, nothing is trimmed
            return False
        self.trims.append(address)
        return True

    def untrim(self, address: int) -> bool:
        if self.asleep:
            raise AllocatorError("untrim", "scratch", "tag 'scratch' is asleep or going to sleep")
        if self.refuse_untrim:
            raise AllocatorError("untrim", "scratch", "out of device memory")
        self.untrims.append(address)
        return True

    def snapshot(self, pool: FakePool) -> list[dict[str, Any]]:
        out = []
        for address, live in pool.segments.items():
            state = "active_allocated" if live else "inactive"
            block = {"address": address, "size": 2 * MiB, "state": state}
            seg = {"address": address, "total_size": 2 * MiB, "allocated_size": live, "blocks": [block]}
            out.append({**seg, "device": 0, "stream": 7})
        return out

    def segment(self, pool: FakePool, live: bool) -> int:
        address = self.next_address
        self.next_address += 2 * MiB
        pool.segments[address] = 2 * MiB if live else 0
        return address


def test_a_block_end_trims_its_free_segments_and_keeps_live_ones() -> None:
    """Leaving a block trims the segments its pool holds entirely free; segments with a live block stay."""
    h = Harness()
    block = h.blocks.enter("scratch")
    free = h.segment(block.mempool, live=False)
    live = h.segment(block.mempool, live=True)
    h.blocks.leave(block)
    assert h.trims == [free] and live not in h.trims
    assert h.blocks.trimmed_bytes == 2 * MiB


def test_an_open_pool_is_never_trimmed() -> None:
    """A pool whose block is still open (in this or another thread) keeps its free segments: torch may hand them out."""
    h = Harness()
    outer = h.blocks.enter("scratch")
    h.segment(outer.mempool, live=False)
    other = h.blocks.enter("scratch")  # another block of the tag at the same time gets a pool of its own
    assert other.mempool is not outer.mempool
    h.blocks.leave(other)
    h.blocks.trim()
    assert h.trims == []
    h.blocks.leave(outer)
    assert len(h.trims) == 1


def test_a_block_boundary_trims_only_when_no_other_block_is_open() -> None:
    """While another thread's block is open a block end leaves free segments for later; the next quiet boundary or trim() takes them."""
    h = Harness()
    other = h.blocks.enter("weights")  # another thread's block, open throughout
    block = h.blocks.enter("scratch")
    seg = h.segment(block.mempool, live=False)
    h.blocks.leave(block)
    assert h.trims == []
    h.blocks.leave(other)  # a quiet moment, but only the weights tag's pools are looked at
    assert h.trims == []
    h.blocks.leave(h.blocks.enter("scratch"))  # the idle pool serves this block; its end is quiet
    assert h.trims == [seg]


def test_a_reused_pool_gets_its_trimmed_segments_back_before_its_block_starts() -> None:
    """Entering the tag again reuses the idle pool: its trimmed segments are untrimmed first; 100 blocks, one pool."""
    h = Harness()
    block = h.blocks.enter("scratch")
    seg = h.segment(block.mempool, live=False)
    pool = block.mempool
    h.blocks.leave(block)
    assert h.trims == [seg]
    again = h.blocks.enter("scratch")
    assert again.mempool is pool and h.untrims == [seg]
    h.blocks.leave(again)
    assert h.trims == [seg, seg]  # free again at the end of the block: trimmed again
    for _ in range(100):
        h.blocks.leave(h.blocks.enter("scratch"))
    assert h.made == 1 and h.blocks.counts() == (1, 0)


def test_under_pressure_a_block_gets_a_new_pool_and_the_trimmed_segments_stay_free() -> None:
    """Mapping an idle pool's trimmed segments back would take more than half the free memory: a new pool serves the block, nothing is untrimmed."""
    h = Harness()
    block = h.blocks.enter("scratch")
    seg = h.segment(block.mempool, live=False)
    h.blocks.leave(block)
    assert h.trims == [seg]
    h.device_free = 3 * MiB  # the 2 MiB segment would leave 1 MiB
    pressed = h.blocks.enter("scratch")
    assert pressed.mempool is not block.mempool and h.untrims == []
    h.blocks.leave(pressed)
    h.device_free = 64 * MiB  # room again: idle pools serve the next blocks (no third pool), as without pressure
    first, second = h.blocks.enter("scratch"), h.blocks.enter("scratch")
    assert h.made == 2 and h.untrims == [seg]  # the trimmed segment is mapped back once its pool serves a block
    h.blocks.leave(first)
    h.blocks.leave(second)


def test_under_pressure_a_pool_whose_freed_segment_has_run_is_not_entered_with_it_mapped() -> None:
    """A segment freed under queued work that has run by the next block: under pressure that block gets a new pool and the segment is trimmed (torch's pool frees it before it gives up)."""
    h = Harness()
    block = h.blocks.enter("scratch")
    free = h.segment(block.mempool, live=False)
    h.kernel()  # the freed tensor's last kernel, still queued at the block's end
    h.blocks.leave(block)
    assert h.pending == {free: 7} and h.trims == []
    h.drain()  # it ran before the next block began (a fast device, a slow host)
    h.device_free = 1 * MiB  # the 2 MiB the free segment holds is more than the device has free
    again = h.blocks.enter("scratch")
    assert again.mempool is not block.mempool, "the block's pool keeps the freed 2 MiB mapped: out of memory"
    assert h.trims == [free] and h.pending == {}
    h.blocks.leave(again)


def test_a_segment_freed_after_its_block_goes_at_the_next_block_end_or_before_a_sleep() -> None:
    """A tensor freed after its block ended: its segment is trimmed by trim() (a sleep) or when a block of the tag ends."""
    h = Harness()
    block = h.blocks.enter("scratch")
    seg = h.segment(block.mempool, live=True)
    h.blocks.leave(block)
    assert h.trims == []
    block.mempool.segments[seg] = 0  # torch freed the tensor after the block
    assert h.blocks.trim(["scratch"]) == 2 * MiB and h.trims == [seg]
    assert h.blocks.trim(["scratch"]) == 0  # trimmed once


def test_a_pool_that_cannot_get_its_segments_back_is_not_reused() -> None:
    """When an awake tag's trimmed segments cannot be mapped (the device is full), the block gets a new pool; the idle one stays trimmed."""
    h = Harness()
    block = h.blocks.enter("scratch")
    h.segment(block.mempool, live=False)
    first = block.mempool
    h.blocks.leave(block)
    h.refuse_untrim = True
    again = h.blocks.enter("scratch")
    assert again.mempool is not first and h.made == 2 and h.untrims == []
    h.blocks.leave(again)
    h.refuse_untrim = False
    assert h.blocks.enter("scratch").mempool in (first, again.mempool)


def test_a_free_segment_whose_stream_still_has_queued_work_is_unmapped_only_once_it_ran() -> None:
    """A segment freed while a kernel queued before the free has not run is marked, not trimmed; a later boundary trims it once the stream ran that work (issue 26)."""
    h = Harness()
    block = h.blocks.enter("scratch")
    free = h.segment(block.mempool, live=False)
    h.kernel()  # e.g. the fill of a tensor just dropped, queued behind a long product
    h.blocks.leave(block)
    assert h.trims == [] and h.marks == [{(0, 7)}]
    h.blocks.trim(["scratch"], settled=False)  # a later boundary while the work is still queued: nothing unmapped
    assert h.trims == []
    h.drain()
    h.blocks.trim(["scratch"], settled=False)
    assert h.trims == [free] and len(h.marks) == 1  # marked once, trimmed once its work ran


def test_a_pool_whose_free_segments_wait_for_their_stream_stays_idle_and_pending_while_a_new_pool_serves_the_block() -> (
    None
):
    """A block does not reuse a pool whose free segments queued work may still touch: they stay pending (reclaimable under pressure) and the block gets a new pool; nothing is trimmed under a block."""
    h = Harness()
    block = h.blocks.enter("scratch")
    free = h.segment(block.mempool, live=False)
    h.kernel()
    h.blocks.leave(block)
    assert h.pending == {free: 7}  # marked at the block's end, pended with its stream
    again = h.blocks.enter("scratch")
    assert again.mempool is not block.mempool and h.pending == {free: 7} and h.trims == []
    h.drain()
    h.blocks.leave(again)
    assert h.trims == [free] and h.pending == {}  # its work ran: trimmed at the next quiet boundary


def test_a_segment_reclaimed_under_pressure_is_mapped_again_before_its_pool_serves_a_block() -> None:
    """A pending segment an allocation under pressure trimmed is learned at the next boundary: untrimmed before its pool is reused."""
    h = Harness()
    block = h.blocks.enter("scratch")
    free = h.segment(block.mempool, live=False)
    h.kernel()
    h.blocks.leave(block)
    other = h.blocks.enter("scratch")
    h.pressure()  # the new block's allocation ran out of memory: the table waited for stream 7 and trimmed it
    h.blocks.leave(other)
    h.drain()
    third = h.blocks.enter("scratch")
    assert third.mempool is block.mempool and h.untrims == [free]  # learned from the table, mapped again first
    assert h.pending == {} and free not in third.trimmed


def test_at_the_pool_limit_a_pool_with_pending_segments_is_entered_again_and_they_stay_mapped() -> None:
    """Once a tag has MAX_POOLS pools, a block reuses the pool with pending segments: they are unpended (torch may hand them out) and stay mapped."""
    from torpor.allocator.torchside.trim import MAX_POOLS

    h = Harness()
    blocks = [h.blocks.enter("scratch") for _ in range(MAX_POOLS)]
    frees = [h.segment(b.mempool, live=False) for b in blocks]
    h.kernel()
    for b in blocks:
        h.blocks.leave(b)
    assert set(h.pending) == set(frees)
    again = h.blocks.enter("scratch")
    assert again.mempool in [b.mempool for b in blocks] and again.marked == {}
    assert h.trims == [] and len(h.pending) == MAX_POOLS - 1


def test_a_sleep_trims_every_free_segment_at_once_after_the_devices_synchronized() -> None:
    """trim(settled=True) (a sleep, after synchronizing) gives back every free segment of idle pools, queued work or not."""
    h = Harness()
    block = h.blocks.enter("scratch")
    free = h.segment(block.mempool, live=False)
    h.kernel()
    h.blocks.leave(block)
    assert h.blocks.trim(["scratch"]) == 2 * MiB and h.trims == [free]


def test_nothing_is_trimmed_when_trimming_is_off() -> None:
    """With trimming off (TORPOR_TRIM_FREE_SEGMENTS=0) pools are still reused per block but no segment is ever trimmed."""
    h = Harness()
    h.blocks.enabled = False
    block = h.blocks.enter("scratch")
    h.segment(block.mempool, live=False)
    h.blocks.leave(block)
    assert h.blocks.trim() == 0 and h.trims == []
    assert h.blocks.enter("scratch").mempool is block.mempool


def test_the_switch_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORPOR_TRIM_FREE_SEGMENTS: unset is on, 0 is off, 1 is on, anything else is refused with its name."""
    monkeypatch.delenv("TORPOR_TRIM_FREE_SEGMENTS", raising=False)
    assert trim_enabled() is True
    monkeypatch.setenv("TORPOR_TRIM_FREE_SEGMENTS", "0")
    assert trim_enabled() is False
    monkeypatch.setenv("TORPOR_TRIM_FREE_SEGMENTS", "1")
    assert trim_enabled() is True
    monkeypatch.setenv("TORPOR_TRIM_FREE_SEGMENTS", "maybe")
    with pytest.raises(ValueError, match="TORPOR_TRIM_FREE_SEGMENTS"):
        trim_enabled()


def test_blocks_in_many_threads_never_share_a_pool_and_pools_stay_few() -> None:
    """8 threads entering and leaving blocks of one tag: no pool serves two open blocks; at most 8 pools exist."""
    h = Harness()
    lock = threading.Lock()
    using: set[int] = set()
    shared: list[int] = []

    def work() -> None:
        for _ in range(300):
            block = h.blocks.enter("scratch")
            with lock:
                if block.mempool.ident in using:
                    shared.append(block.mempool.ident)
                using.add(block.mempool.ident)
                h.segment(block.mempool, live=False)
            with lock:
                using.discard(block.mempool.ident)
            h.blocks.leave(block)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not shared, "a pool served two open blocks at once"
    assert h.made <= 8 and h.blocks.counts() == (h.made, 0)
    assert len(set(h.trims)) == 2400


def test_a_free_segment_of_a_sleeping_tag_is_not_counted_as_trimmed_and_goes_after_the_wake() -> None:
    """A trim while the tag sleeps: the table trims nothing, nothing is counted; the first trim after the wake gives the segment back."""
    h = Harness()
    block = h.blocks.enter("scratch")
    free = h.segment(block.mempool, live=True)
    h.blocks.leave(block)
    block.mempool.segments[free] = 0  # freed while asleep
    h.asleep = True
    assert h.blocks.trim(["scratch"]) == 0 and h.trims == [] and h.blocks.trimmed_bytes == 0
    h.asleep = False
    assert h.blocks.trim(["scratch"]) == 2 * MiB and h.trims == [free]


def test_empty_gives_back_an_idle_pools_free_segment_once_its_queued_work_has_run() -> None:
    """empty() (torch.cuda.empty_cache()'s part) marks a free segment of an idle pool, waits for its stream and trims it; an open pool's stays."""
    h = Harness()
    waited: list[object] = []

    def wait(token: object) -> bool:
        waited.append(token)
        h.drain()
        return True

    h.blocks._wait = wait
    idle = h.blocks.enter("scratch")
    h.blocks.leave(idle)
    h.kernel()  # a kernel on a tensor of the idle pool, then the tensor freed outside any block
    late = h.segment(idle.mempool, live=False)
    busy = h.blocks.enter("scratch")  # marks it (its work is queued): the block gets a new pool
    kept = h.segment(busy.mempool, live=False)
    assert h.trims == []
    assert h.blocks.empty(["scratch"]) == 2 * MiB and waited
    assert h.trims == [late] and kept not in h.trims
