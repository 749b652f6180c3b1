"""get_cpu_backup's reading side: the host spans of a paused tag's backup that hold a range, and who owns an address."""

from __future__ import annotations

from torpor.allocator import SimDriver, TaggedAllocator
from torpor.tms.hostcopy import backup_spans, not_found, owning_tag, read_spans
from torpor.tms.tmsengine import TmsEngine
from torpor.tms.tmsenv import TmsSettings

MiB = 1 << 20


def paused_weights() -> tuple[TmsEngine, int, bytes]:
    """An engine whose weights tag (CPU backup) holds known bytes and is paused."""
    e = TmsEngine("torch", allocator=TaggedAllocator(SimDriver(64 * MiB)), settings=TmsSettings(), telemetry=False)
    with e.region("weights", True, False, None):
        w = e.allocator.allocate(4 * MiB)
    data = bytes(range(256)) * 16
    e.allocator.write(w + 4096, data)
    e.pause("weights")
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
