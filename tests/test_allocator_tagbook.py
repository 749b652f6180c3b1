"""Tests of torpor.allocator.tagbook: each tag's record, usage by residency, and the tag each thread routes to."""

from __future__ import annotations

import threading

from torpor.allocator import SimDriver
from torpor.allocator.table import NativeTable
from torpor.allocator.tagbook import TagBook

G = 64 * 1024


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
