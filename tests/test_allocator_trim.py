"""Tests of per-block pools (BlockPools): free segments of retired pools trimmed, dead pools destroyed only when quiet."""

from __future__ import annotations

import threading
from typing import Any

from torpor.allocator.trim import BlockPools

MiB = 1 << 20


class FakePool:
    """A torch MemPool stand-in: segments (address -> live bytes), destruction recorded."""

    destroyed: list[int] = []  # noqa: RUF012 - shared record of destroyed pools
    inside: list[int] = []  # noqa: RUF012 - blocks open when a pool was destroyed (torch would abort if > 0)

    def __init__(self, ident: int, owner: Harness) -> None:
        self.ident = ident
        self.owner = owner
        self.segments: dict[int, int] = {}

    def use_count(self) -> int:
        return 1

    def __del__(self) -> None:
        FakePool.destroyed.append(self.ident)
        FakePool.inside.append(self.owner.blocks.counts()[2])


class Harness:
    """BlockPools over fake pools: records trims and hands out segment addresses."""

    def __init__(self) -> None:
        self.trims: list[int] = []
        self.made = 0
        self.next_address = 0x1000_0000
        self.blocks = BlockPools(self.new_pool, self.trims.append, self.snapshot)

    def new_pool(self, tag: str) -> FakePool:
        self.made += 1
        return FakePool(self.made, self)

    def snapshot(self, pool: FakePool) -> list[dict[str, Any]]:
        out = []
        for address, live in pool.segments.items():
            state = "active_allocated" if live else "inactive"
            out.append(
                {
                    "address": address,
                    "total_size": 2 * MiB,
                    "allocated_size": live,
                    "blocks": [{"address": address, "size": 2 * MiB, "state": state}],
                }
            )
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


def test_an_open_block_is_never_trimmed() -> None:
    """A pool whose block is still open (in this or another thread) keeps its free segments: torch may hand them out."""
    h = Harness()
    outer = h.blocks.enter("scratch")
    h.segment(outer.mempool, live=False)
    other = h.blocks.enter("scratch")  # another block of the tag (another thread): the outer one is still open
    h.blocks.leave(other)
    h.blocks.trim()
    assert h.trims == []
    h.blocks.leave(outer)
    assert len(h.trims) == 1


def test_entering_again_trims_what_was_freed_after_the_block_ended() -> None:
    """A tensor freed after its block ended: its segment goes back when a block of the tag is entered again."""
    h = Harness()
    block = h.blocks.enter("scratch")
    seg = h.segment(block.mempool, live=True)
    pool = block.mempool
    h.blocks.leave(block)
    assert h.trims == []
    pool.segments[seg] = 0  # torch freed the tensor after the block
    del pool
    h.blocks.leave(h.blocks.enter("scratch"))
    assert h.trims == [seg]


def test_a_segment_is_trimmed_once() -> None:
    """Later trims skip a segment already given back (its pool stays until it can be destroyed)."""
    h = Harness()
    hold = h.blocks.enter("other")  # keeps the dead pool from being destroyed
    block = h.blocks.enter("scratch")
    seg = h.segment(block.mempool, live=False)
    h.blocks.leave(block)
    h.blocks.trim()
    h.blocks.trim(["scratch"])
    assert h.trims == [seg]
    h.blocks.leave(hold)


def test_dead_pools_are_destroyed_only_when_no_block_or_capture_is_open() -> None:
    """A retired pool with every segment free is destroyed at the first moment no block and no capture is open, never before."""
    FakePool.destroyed.clear()
    FakePool.inside.clear()
    h = Harness()
    long_block = h.blocks.enter("weights")  # another thread's block stays open
    block = h.blocks.enter("scratch")
    h.segment(block.mempool, live=False)
    ident = block.mempool.ident
    h.blocks.leave(block)
    del block
    assert ident not in FakePool.destroyed, "a pool was destroyed while another block was open"
    assert h.blocks.counts()[1] == 1
    with h.blocks.hold():  # a capture starts
        h.blocks.leave(long_block)
        assert ident not in FakePool.destroyed, "a pool was destroyed during a capture"
    assert ident in FakePool.destroyed
    assert set(FakePool.inside) == {0}
    assert h.blocks.counts() == (0, 0, 0)  # the weights block's pool (it made no segment) went too


def test_a_pool_referenced_elsewhere_is_not_destroyed() -> None:
    """A dead pool that something else still references (a frame, a graph) stays until that reference goes."""
    FakePool.destroyed.clear()
    h = Harness()
    block = h.blocks.enter("scratch")
    kept = block.mempool
    h.blocks.leave(block)
    assert kept.ident not in FakePool.destroyed
    ident = kept.ident
    del kept
    h.blocks.trim()
    assert ident in FakePool.destroyed


def test_blocks_in_many_threads_never_see_a_pool_destroyed_while_one_is_open() -> None:
    """8 threads entering and leaving blocks (freeing everything each time): every pool is destroyed with no block open."""
    FakePool.destroyed.clear()
    FakePool.inside.clear()
    h = Harness()
    lock = threading.Lock()

    def work() -> None:
        for _ in range(200):
            block = h.blocks.enter("scratch")
            with lock:
                h.segment(block.mempool, live=False)
            h.blocks.leave(block)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    h.blocks.trim()
    assert set(FakePool.inside) <= {0}
    assert len(h.trims) == 1600
    assert h.blocks.counts() == (0, 0, 0) and len(FakePool.destroyed) == 1600
