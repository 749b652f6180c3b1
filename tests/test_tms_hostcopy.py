"""get_cpu_backup's reading side: the host spans of a paused tag's backup that hold a range, and who owns an address."""

from __future__ import annotations

from torpor.allocator import SimDriver, TaggedAllocator
from torpor.tms.hostcopy import backup_spans, not_found, owning_tag, read_spans
from torpor.units import MiB


class Paused:
    """An allocator whose weights tag holds known bytes, backed up and released (the graph pool's path)."""

    def __init__(self) -> None:
        self.allocator = TaggedAllocator(SimDriver(64 * MiB))

    def resume(self, tag: str) -> None:
        """Restore ``tag`` and drop its backup, as a wake does."""
        self.allocator.restore([tag])
        self.allocator.drop_backup([tag])


def paused_weights() -> tuple[Paused, int, bytes]:
    """The weights tag with known bytes, backed up by the allocator and released."""
    e = Paused()
    w = e.allocator.allocate(4 * MiB, tag="weights")
    data = bytes(range(256)) * 16
    e.allocator.write(w + 4096, data)
    e.allocator.backup(["weights"])
    e.allocator.release(["weights"])
    return e, w, data


def test_a_paused_tags_backup_holds_the_bytes() -> None:
    """The spans for a range inside a paused, backed-up allocation read back the bytes written before the pause."""
    e, w, data = paused_weights()
    spans = backup_spans(e.allocator, ["weights"], w + 4096, len(data))
    assert spans is not None
    assert read_spans(spans) == data


def test_no_backup_no_spans() -> None:
    """An awake tag (its backup dropped by the wake) or a tag not asked about gives None."""
    e, w, data = paused_weights()
    assert backup_spans(e.allocator, ["kv_cache"], w, 16) is None
    e.resume("weights")
    assert backup_spans(e.allocator, ["weights"], w, 16) is None
    assert e.allocator.read(w + 4096, len(data)) == data


def test_owning_tag() -> None:
    """The tag holding an allocation that contains the range; None past its end or for another tag."""
    e, w, _ = paused_weights()
    assert owning_tag(e.allocator, ["weights"], w + 100, 100) == "weights"
    assert owning_tag(e.allocator, ["weights"], w + 4 * MiB - 10, 100) is None
    assert owning_tag(e.allocator, ["kv_cache"], w, 1) is None
    assert "region" in str(not_found(w, 8))
