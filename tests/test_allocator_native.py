"""Tests of the native library itself (csrc/): its symbols, torch's malloc/free slots under threads, slabs, frozen tags, the build."""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support import RigMaker

from torpor.allocator import AllocatorError, AllocatorOutOfMemory, TaggedAllocator
from torpor.allocator.native import library as native
from torpor.testrig import GRANULE as G
from torpor.units import MiB

ROOT = Path(__file__).resolve().parent.parent
MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


def slot(alloc: TaggedAllocator, tag: str) -> tuple[object, object]:
    """The malloc/free pair torch would get for ``tag``, callable from Python (ctypes drops the GIL around them)."""
    alloc.tag_state(tag)
    m, f = alloc._table.slot(tag)
    return MALLOC(m), FREE(f)


def test_library_links_no_python_symbol() -> None:
    """nm -D of the library shows no Python (Py*, _Py*) symbol, defined or needed: it runs without the GIL."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", str(native.library_path())], check=True, capture_output=True, text=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "tp_slot_bind" in names and "tp_alloc_raw" in names
    assert not [n for n in names if n.startswith(("Py", "_Py"))]


def test_slots_allocate_and_free_in_their_tags_from_any_thread(make_rig: RigMaker) -> None:
    """Frees route by slot, not by thread: four threads allocate in four tags, others free them, bookkeeping stays exact."""
    rig = make_rig("batched_large")
    pairs = {f"t{i}": slot(rig.allocator, f"t{i}") for i in range(4)}
    made: list[tuple[str, int]] = []
    lock = threading.Lock()

    def allocate(tag: str) -> None:
        malloc, _ = pairs[tag]
        rng = random.Random(tag)
        for _ in range(200):
            p = malloc(rng.choice([1, G, 3 * G]), 0, None)  # type: ignore[operator]
            assert p
            with lock:
                made.append((tag, p))

    threads = [threading.Thread(target=allocate, args=(t,)) for t in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(rig.allocator.usage()[t].allocations for t in pairs) == 800
    random.Random(1).shuffle(made)

    def free(part: list[tuple[str, int]]) -> None:
        for tag, p in part:
            pairs[tag][1](p, 0, 0, None)  # type: ignore[operator]

    threads = [threading.Thread(target=free, args=(made[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(rig.allocator.usage()[t].allocations == 0 for t in pairs)
    assert rig.driver.used == 0 and rig.driver.mapped_ranges() == [] and rig.allocator.pending_errors() == []


def test_threads_allocate_while_another_sleeps_and_wakes_their_neighbour(make_rig: RigMaker) -> None:
    """Threads malloc/free in their tags while the main thread backs up, releases and restores another tag: every byte kept."""
    rig = make_rig("batched_large", capacity=1 << 30)
    data = {rig.allocator.allocate(n, "weights"): os.urandom(n) for n in (G, 3 * G, 5 * G, G)}
    for a, b in data.items():
        rig.allocator.write(a, b)
    pairs = {f"w{i}": slot(rig.allocator, f"w{i}") for i in range(4)}
    stop = threading.Event()
    failures: list[str] = []

    def churn(tag: str) -> None:
        malloc, free = pairs[tag]
        rng = random.Random(tag)
        live: list[int] = []
        while not stop.is_set():
            if live and rng.random() < 0.5:
                free(live.pop(rng.randrange(len(live))), 0, 0, None)  # type: ignore[operator]
            else:
                p = malloc(rng.choice([1, G, 2 * G, 7 * G]), 0, None)  # type: ignore[operator]
                if not p:
                    failures.append(tag)
                    return
                live.append(p)
        for p in live:
            free(p, 0, 0, None)  # type: ignore[operator]

    threads = [threading.Thread(target=churn, args=(t,)) for t in pairs]
    for t in threads:
        t.start()
    for _ in range(30):
        rig.allocator.backup(["weights"])
        rig.allocator.release(["weights"])
        rig.allocator.restore(["weights"])
        rig.allocator.drop_backup(["weights"])
        assert all(rig.allocator.read(a, len(b)) == b for a, b in data.items())
    stop.set()
    for t in threads:
        t.join()
    assert not failures and rig.allocator.pending_errors() == []
    assert all(rig.allocator.usage()[t].allocations == 0 for t in pairs)
    assert rig.driver.used == sum(rig.allocator.size_of(a) for a in data)


def test_failed_malloc_returns_null_and_the_reason_reaches_python(make_rig: RigMaker) -> None:
    """An out-of-memory malloc returns NULL (nothing raised in C); pending_errors() gives the reason as AllocatorOutOfMemory."""
    rig = make_rig("batched_large")
    malloc, _ = slot(rig.allocator, "kv_cache")
    rig.driver.fail("create", oom=True)
    assert not malloc(4 * G, 0, None)  # type: ignore[operator]
    errors = rig.allocator.pending_errors()
    assert len(errors) == 1 and isinstance(errors[0], AllocatorOutOfMemory)
    assert errors[0].tag == "kv_cache" and errors[0].operation == "allocate" and "out of memory" in str(errors[0])
    assert rig.allocator.pending_errors() == [] and rig.driver.used == 0


def test_one_granule_allocations_share_slabs_that_double(make_rig: RigMaker) -> None:
    """One-granule allocations fill slabs of 2, 4, 8 granules (one driver map each); larger ones get their own mapping."""
    rig = make_rig("batched_large", slab_bytes=8 * G)
    for _ in range(2 + 4 + 8 + 8):
        rig.allocator.allocate(G, "w")
    assert rig.driver.count("map") == 4 and rig.allocator.slabs.count() == 4 and rig.allocator.slabs.spare_bytes() == 0
    rig.allocator.allocate(2 * G, "w")
    assert rig.driver.count("map") == 5


def test_a_granule_freed_in_a_slab_is_reused_and_the_last_free_unmaps_the_slab(make_rig: RigMaker) -> None:
    """A freed slab granule is taken by the next one-granule allocation without a driver call; the slab goes with its last user."""
    rig = make_rig("batched_large")
    a, b = rig.allocator.allocate(G, "w"), rig.allocator.allocate(G, "w")
    rig.allocator.free(a)
    maps = rig.driver.count("map")
    assert rig.allocator.allocate(G, "w") == a and rig.driver.count("map") == maps
    rig.allocator.free(a)
    rig.allocator.free(b)
    assert rig.allocator.slabs.count() == 0 and rig.driver.used == 0 and rig.driver.mapped_ranges() == []


def test_frees_during_a_sleep_keep_mappings_until_the_release(make_rig: RigMaker) -> None:
    """Between backup and release a free unmaps nothing (copies may be in flight); the release takes it all, the wake skips it."""
    rig = make_rig("batched_large")
    a, b = rig.allocator.allocate(2 * G, "w"), rig.allocator.allocate(2 * G, "w")
    rig.allocator.write(b, b"k" * 2 * G)
    rig.allocator.backup(["w"])
    unmaps = rig.driver.count("unmap")
    rig.allocator.free(a)
    assert rig.driver.count("unmap") == unmaps and rig.allocator.usage()["w"].allocations == 1
    rig.allocator.release(["w"])
    assert rig.driver.used == 0
    rig.allocator.restore(["w"])
    assert rig.driver.used == 2 * G and rig.allocator.read(b, 2 * G) == b"k" * 2 * G


def test_a_called_off_sleep_unmaps_what_was_freed_meanwhile(make_rig: RigMaker) -> None:
    """A backup dropped without a release thaws the tag: mappings freed while frozen go then."""
    rig = make_rig("batched_large")
    a = rig.allocator.allocate(2 * G, "w")
    rig.allocator.allocate(2 * G, "w")
    rig.allocator.backup(["w"])
    rig.allocator.free(a)
    assert rig.driver.used == 4 * G
    rig.allocator.drop_backup(["w"])
    assert rig.driver.used == 2 * G and rig.allocator.allocate(G, "w")


def test_more_than_sixty_four_tags_is_a_clear_error(make_rig: RigMaker) -> None:
    """The table holds 64 tags; the 65th is refused with a reason, not a crash."""
    rig = make_rig("batched_large")
    for i in range(64):
        rig.allocator.tag_state(f"t{i}")
    with pytest.raises(AllocatorError, match="at most 64 tags"):
        rig.allocator.allocate(G, "one-too-many")


def test_build_without_a_compiler_names_what_to_install(tmp_path: Path) -> None:
    """pip's build (setup.py build_ext) with no C compiler stops with a message naming the package to install."""
    env = {**os.environ, "CC": "no-such-cc-torpor", "PATH": os.environ.get("PATH", "")}
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path), "--build-temp", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert "found no C compiler" in proc.stderr and "apt-get install gcc" in proc.stderr


def test_every_slot_routes_to_its_own_tag(make_rig: RigMaker) -> None:
    """Forty tags get forty slots; each slot's malloc lands in its own tag (slots are numbered 0..127, none skipped)."""
    rig = make_rig("batched_large")
    pairs = {f"s{i}": slot(rig.allocator, f"s{i}") for i in range(40)}
    for malloc, _ in pairs.values():
        assert malloc(G, 0, None)  # type: ignore[operator]
    assert all(rig.allocator.usage()[t].allocations == 1 for t in pairs)


def test_release_again_on_a_kept_backup_refuses_allocations_made_after_it(make_rig: RigMaker) -> None:
    """After a wake the backup is kept: releasing on it works, unless an allocation was made since (it has no backup)."""
    rig = make_rig("batched_large")
    a = rig.allocator.allocate(2 * G, "w")
    rig.allocator.write(a, b"q" * 2 * G)
    rig.allocator.backup(["w"])
    rig.allocator.release(["w"])
    rig.allocator.restore(["w"])
    rig.allocator.release(["w"])  # a failed wake's rollback does this
    assert rig.driver.used == 0
    rig.allocator.restore(["w"])
    assert rig.allocator.read(a, 2 * G) == b"q" * 2 * G
    rig.allocator.allocate(G, "w")
    with pytest.raises(AllocatorError, match="made after its backup"):
        rig.allocator.release(["w"])
    assert rig.allocator.usage()["w"].resident == 3 * G


def test_trim_gives_a_segment_back_but_keeps_its_address_until_torch_frees_it(make_rig: RigMaker) -> None:
    """A trimmed segment's memory goes at once; usage no longer counts it; its address is not reused before the free."""
    rig = make_rig("batched_large")
    a = rig.allocator.allocate(2 * G, "w")
    b = rig.allocator.allocate(2 * G, "w")
    assert rig.allocator._table.trim(a) is True
    assert rig.allocator._table.trim(a) is False  # idempotent: trimmed already
    assert (
        rig.driver.used == 2 * G
        and rig.allocator.usage()["w"].allocations == 1
        and rig.allocator.usage()["w"].resident == 2 * G
    )
    c = rig.allocator.allocate(2 * G, "w")
    assert c not in (a, b)
    rig.allocator.free(a)  # torch drops the pool: the record goes, the address is free again
    assert rig.allocator.allocate(2 * G, "w") == a


def test_a_trimmed_slab_granule_is_not_handed_out_before_torch_frees_it(make_rig: RigMaker) -> None:
    """Inside a slab a trimmed granule stays taken (torch still holds it); freed, it is spare again."""
    rig = make_rig("batched_large", slab_bytes=8 * G)
    first, second = rig.allocator.allocate(G, "w"), rig.allocator.allocate(G, "w")
    rig.allocator._table.trim(first)
    third = rig.allocator.allocate(G, "w")
    assert third not in (first, second) and rig.allocator.slabs.count() == 2
    rig.allocator.free(first)
    assert rig.allocator.allocate(G, "w") == first


def test_a_sleep_trims_nothing_torch_holds_live_and_skips_trimmed_segments(make_rig: RigMaker) -> None:
    """A trimmed segment is neither backed up nor mapped back on wake; the live ones come back bit-exact."""
    rig = make_rig("batched_large")
    a, b = rig.allocator.allocate(2 * G, "w"), rig.allocator.allocate(2 * G, "w")
    rig.allocator.write(b, b"b" * 2 * G)
    rig.allocator._table.trim(a)
    moved = rig.allocator.backup(["w"])["w"].bytes
    rig.allocator.release(["w"])
    rig.allocator.restore(["w"])
    assert moved == 2 * G and rig.driver.used == 2 * G and rig.allocator.read(b, 2 * G) == b"b" * 2 * G


def test_untrim_maps_a_trimmed_segment_again_and_counts_it(make_rig: RigMaker) -> None:
    """A trimmed segment untrimmed (its pool serves a block again) is mapped, counted and writable; untrim again says no."""
    rig = make_rig("batched_large")
    a = rig.allocator.allocate(2 * G, "w")
    rig.allocator._table.trim(a)
    assert rig.driver.used == 0 and rig.allocator.usage()["w"].allocations == 0
    assert rig.allocator._table.untrim(a) is True
    assert rig.driver.used == 2 * G and rig.allocator.usage()["w"].resident == 2 * G
    rig.allocator.write(a, b"x" * 2 * G)
    assert rig.allocator.read(a, 2 * G) == b"x" * 2 * G
    assert rig.allocator._table.untrim(a) is False
    rig.allocator.free(a)
    assert rig.driver.used == 0


def test_untrim_of_a_slab_granule_counts_it_on_the_live_slab(make_rig: RigMaker) -> None:
    """A trimmed granule of a slab still mapped becomes a user again: freeing its neighbour keeps the slab mapped."""
    rig = make_rig("batched_large", slab_bytes=8 * G)
    first, second = rig.allocator.allocate(G, "w"), rig.allocator.allocate(G, "w")
    rig.allocator._table.trim(first)
    assert rig.allocator._table.untrim(first)
    mapped = rig.driver.used
    rig.allocator.free(second)
    assert rig.driver.used == mapped and rig.allocator.usage()["w"].allocations == 1
    rig.allocator.free(first)
    assert rig.driver.used == 0


def test_untrim_while_asleep_is_refused_and_the_segment_stays_trimmed(make_rig: RigMaker) -> None:
    """Untrimming in a released tag raises AllocatorError; after the wake it works and the live data is intact."""
    rig = make_rig("batched_large")
    a, b = rig.allocator.allocate(2 * G, "w"), rig.allocator.allocate(2 * G, "w")
    rig.allocator.write(b, b"b" * 2 * G)
    rig.allocator._table.trim(a)
    rig.allocator.backup(["w"])
    rig.allocator.release(["w"])
    with pytest.raises(AllocatorError, match="asleep"):
        rig.allocator._table.untrim(a)
    rig.allocator.restore(["w"])
    rig.allocator.drop_backup(["w"])
    assert rig.allocator._table.untrim(a) and rig.driver.used == 4 * G
    assert rig.allocator.read(b, 2 * G) == b"b" * 2 * G


def test_trim_of_a_tag_going_to_sleep_waits_and_of_a_released_tag_keeps_the_wake_off_it(make_rig: RigMaker) -> None:
    """Frozen for a sleep: trim returns False and leaves the record; released: trim takes it, the wake maps nothing of it, untrim maps it again."""
    rig = make_rig("batched_large")
    a = rig.allocator.allocate(2 * G, "w")
    rig.allocator.backup(["w"])
    assert rig.allocator._table.trim(a) is False  # its backup is in flight: the release takes it
    rig.allocator.release(["w"])
    assert (
        rig.allocator._table.trim(a) is True and rig.driver.used == 0
    )  # a segment torch holds free while the tag is asleep
    rig.allocator.restore(["w"])
    rig.allocator.drop_backup(["w"])
    assert rig.driver.used == 0 and rig.allocator.usage()["w"].allocations == 0
    assert rig.allocator._table.untrim(a) is True and rig.driver.used == 2 * G  # its pool serves a block again
    rig.allocator.free(a)
    assert rig.driver.used == 0


def test_a_trim_whose_unmap_fails_is_a_trim_and_the_mapping_goes_at_the_next_sleep(
    caplog: pytest.LogCaptureFixture,
    make_rig: RigMaker,
) -> None:
    """Unmap failing at trim: trim says True (torch's side must record it), logs the failure; the sleep unmaps it later."""
    rig = make_rig("batched_large")
    a, b = rig.allocator.allocate(2 * G, "w"), rig.allocator.allocate(2 * G, "w")
    rig.allocator.write(b, b"b" * 2 * G)
    rig.driver.fail("unmap", reason="the context is broken")
    with caplog.at_level("WARNING", logger="torpor.allocator"):
        assert rig.allocator._table.trim(a) is True
    assert "the context is broken" in caplog.text and "stays mapped" in caplog.text
    assert rig.allocator._table.trim(a) is False and rig.allocator.usage()["w"].allocations == 1
    moved = rig.allocator.backup(["w"])["w"].bytes
    rig.allocator.release(["w"])
    assert moved == 2 * G and rig.driver.used == 0  # the mapping left by the trim went with the sleep
    rig.allocator.restore(["w"])
    rig.allocator.drop_backup(["w"])
    assert rig.allocator._table.untrim(a) is True and rig.driver.used == 4 * G
    rig.allocator.write(a, b"a" * 2 * G)
    assert rig.allocator.read(a, 2 * G) == b"a" * 2 * G and rig.allocator.read(b, 2 * G) == b"b" * 2 * G


def test_untrim_failing_to_map_changes_nothing(make_rig: RigMaker) -> None:
    """A device full at untrim: AllocatorError (out of memory), the segment stays trimmed and uncounted."""
    rig = make_rig("batched_large")
    a = rig.allocator.allocate(2 * G, "w")
    rig.allocator._table.trim(a)
    rig.driver.fail("create", oom=True)
    with pytest.raises(AllocatorError):
        rig.allocator._table.untrim(a)
    assert rig.driver.used == 0 and rig.allocator.usage()["w"].allocations == 0
    assert rig.allocator._table.untrim(a)


def test_untrim_is_all_or_nothing_when_the_table_cannot_grow(make_rig: RigMaker) -> None:
    """Host out of memory growing the mapping table at untrim: nothing changes (no user counted twice); nothing leaks after."""
    rig = make_rig("batched_large", slab_bytes=0)
    a, x, b = rig.allocator.allocate(G, "w"), rig.allocator.allocate(4 * G, "w"), rig.allocator.allocate(G, "w")
    assert (x, b) == (a + G, a + 5 * G)  # adjacent: the wake maps them in shared spans
    rig.allocator.write(b, b"b" * G)
    rig.allocator.backup(["w"])
    rig.allocator.release(["w"])
    rig.allocator.restore(["w"])  # spans of <= 4 G in 2 G pieces: [a, x's first half], [x's second half, b]
    rig.allocator.drop_backup(["w"])
    assert rig.allocator._table.trim(x)
    rig.allocator.free(a)  # the first span goes: x lies half over nothing, half over the span it shares with b
    native.lib().tp_test_fail_growth(1)
    try:
        with pytest.raises(AllocatorError, match="out of host memory"):
            rig.allocator._table.untrim(x)
    finally:
        native.lib().tp_test_fail_growth(0)
    assert (
        rig.driver.used == 3 * G and rig.allocator.usage()["w"].allocations == 1
    )  # as before: the span x shares with b
    assert rig.allocator._table.untrim(x) and rig.driver.used == 5 * G
    rig.allocator.free(x)
    rig.allocator.free(b)
    assert rig.driver.used == 0 and rig.allocator.usage()["w"].allocations == 0


def test_sleep_copies_only_the_blocks_in_use_and_wake_restores_them(
    monkeypatch: pytest.MonkeyPatch, make_rig: RigMaker
) -> None:
    """With half of each segment free in torch's pool, the backup moves half the bytes and the live halves come back."""
    rig = make_rig("batched_large", slab_bytes=0)

    def half_live(tag: str) -> dict[int, list[tuple[int, int]]]:  # the torch side says half of each is in use
        return {a: [(a, n // 2)] for a, n, _ in rig.allocator._table.allocations(tag)}

    monkeypatch.setattr(rig.allocator._torch, "live_ranges", half_live)
    data = {}
    for _ in range(6):
        a = rig.allocator.allocate(4 * G, "w")
        data[a] = os.urandom(4 * G)
        rig.allocator.write(a, data[a])
    moved = rig.allocator.backup(["w"])["w"].bytes
    copied = sum(c.call == "copy_d2h" for c in rig.driver.calls)
    rig.allocator.release(["w"])
    assert moved == 12 * G and rig.driver.used == 0 and copied >= 1
    rig.allocator.restore(["w"])
    assert all(rig.allocator.read(a, 2 * G) == b[: 2 * G] for a, b in data.items())
    assert rig.allocator._host.used_bytes() == 12 * G


def test_an_injected_failure_carries_its_reason_from_the_library_and_from_python(make_rig: RigMaker) -> None:
    """sim.fail(reason=...) names the failure, for a call the library makes (create) and one Python makes (host_alloc)."""
    rig = make_rig("batched_large")
    rig.driver.fail("create", reason="rank 3 is out of luck")
    with pytest.raises(AllocatorError, match="rank 3 is out of luck"):
        rig.allocator.allocate(G, "w")
    rig.driver.fail("host_alloc", oom=True, reason="no pinned memory here")
    with pytest.raises(Exception, match=r"no pinned memory here \(out of memory\)"):
        rig.driver.host_alloc(G)


# -- out-of-range values and unusable names are refused before the C boundary (issue 30) ------------


def test_sizes_addresses_and_devices_that_would_wrap_are_refused_by_value(make_rig: RigMaker) -> None:
    """allocate(2**64 + 4096), free(2**64 + a), device=2**32 or -1 raise ValueError naming the value; nothing changes."""
    rig = make_rig("batched_large")
    kept = rig.allocator.allocate(G, "w")
    before = rig.allocator._table.allocations()
    for nbytes in (2**64 + 4096, 2**64, 2**63):
        with pytest.raises(ValueError, match=f"cannot allocate {nbytes} bytes") as caught:
            rig.allocator.allocate(nbytes, "w")
        assert isinstance(caught.value, AllocatorError)
    for device in (2**32, 2**31, -1, 64):
        with pytest.raises(ValueError, match=rf"device {device}\b"):
            rig.allocator.allocate(G, "w", device=device)
    for address in (2**64 + kept, -kept):
        with pytest.raises(ValueError, match=f"address {address:#x}"):
            rig.allocator.free(address)
        with pytest.raises(ValueError, match="address"):
            rig.allocator._table.trim(address)
    with pytest.raises(ValueError, match="an integer"):
        rig.allocator.allocate(True, "w")  # type: ignore[arg-type]
    assert rig.allocator._table.allocations() == before
    rig.allocator.free(kept)  # the allocation a wrapped address named is still there
    rig.allocator.close()


@pytest.mark.parametrize(
    "tag", ["weights\x00shadow", "", "x" * 64, "\u00e9" * 32, "tab\there", "bad\ud800", b"weights", 7]
)
def test_unusable_tag_names_are_refused_by_name(tag: object, make_rig: RigMaker) -> None:
    """A tag with a NUL (it would share 'weights''s native slot), empty, over 63 UTF-8 bytes, with a control character or not a str is refused."""
    rig = make_rig("batched_large")
    rig.allocator.allocate(G, "weights")
    with pytest.raises(ValueError, match="tag") as caught:
        rig.allocator.tag_state(tag)  # type: ignore[arg-type]
    assert isinstance(caught.value, AllocatorError)
    with pytest.raises(ValueError, match="tag"):
        rig.allocator.allocate(G, tag)  # type: ignore[arg-type]
    assert set(rig.allocator.usage()) == {"weights"} and rig.allocator.usage()["weights"].allocations == 1
    rig.allocator.close()


def test_tag_names_up_to_63_utf8_bytes_are_fine(make_rig: RigMaker) -> None:
    """Names of 63 UTF-8 bytes, non-ASCII or with spaces, are ordinary tags."""
    rig = make_rig("batched_large")
    for tag in ("x" * 63, "\u00e9" * 31 + "x", "kv cache", "\u6743\u91cd"):
        rig.allocator.allocate(G, tag)
    assert all(u.allocations == 1 for u in rig.allocator.usage().values()) and len(rig.allocator.usage()) == 4
    rig.allocator.close()


# -- torch's slots: reused once their allocator is closed and nothing can call them ---------------------


def _bind_all(make_rig: RigMaker, n_allocators: int, tags: int = 5) -> set[int]:
    """Build and close ``n_allocators`` allocators that each bind one slot per tag; the malloc addresses they got."""
    seen: set[int] = set()
    for _ in range(n_allocators):
        rig = make_rig("batched_large", capacity=16 * MiB)
        for i in range(tags):
            rig.allocator.tag_state(f"t{i}")
            seen.add(rig.allocator._table.slot(f"t{i}")[0])
        rig.allocator.close()
    return seen


def test_rebuilding_a_five_tag_allocator_never_runs_out_of_slots(make_rig: RigMaker) -> None:
    """Sixty rebuilds (300 slot binds, over the 128 slots) succeed: a closed allocator's slots are reused."""
    assert len(_bind_all(make_rig, 60)) <= 128


def test_a_slot_torch_still_holds_memory_through_is_not_reused_until_freed(make_rig: RigMaker) -> None:
    """A closed allocator's slot with a block torch never freed stays out of reuse (a late free must not reach another allocator)."""
    rig = make_rig("batched_large", capacity=16 * MiB)
    malloc, free = slot(rig.allocator, "held")
    held = malloc(G, 0, None)  # type: ignore[operator]
    assert held
    address = ctypes.cast(malloc, ctypes.c_void_p).value
    rig.allocator.close()
    assert address not in _bind_all(make_rig, 30)  # 150 binds: every other slot came round again
    free(held, G, 0, None)  # type: ignore[operator]  # torch frees it late (after close): the slot is free now
    assert address in _bind_all(make_rig, 30)


def test_running_out_of_slots_says_who_holds_them(make_rig: RigMaker) -> None:
    """With every slot bound to an open allocator, the next bind names the 128-slot limit and how many open allocators hold."""
    opened = []
    with pytest.raises(AllocatorError, match=r"128 per process.*bound to open allocators") as caught:
        for _ in range(200):
            rig = make_rig("batched_large", capacity=16 * MiB)
            opened.append(rig.allocator)
            rig.allocator.tag_state("t")
            rig.allocator._table.slot("t")
    assert "close()" in str(caught.value)
    for allocator in opened:
        allocator.close()
    assert _bind_all(make_rig, 2)  # closing them gave the slots back


def test_a_closed_allocator_reaches_no_torch_pool_and_binds_no_slot(make_rig: RigMaker) -> None:
    """After close, neither torch's pools of the allocator nor a new slot can be had: its old slots may serve another allocator."""
    rig = make_rig("batched_large", capacity=16 * MiB)
    rig.allocator.tag_state("w")
    rig.allocator.close()
    with pytest.raises(AllocatorError, match="closed"):
        rig.allocator._torch.pools()
    with pytest.raises(AllocatorError, match="closed"):
        rig.allocator._table.slot("w")


def test_torchs_free_of_a_segment_waits_for_its_stream_before_unmapping(make_rig: RigMaker) -> None:
    """A segment torch frees (OOM retry, a freed pool) is unmapped only after its stream's queued work: wait, then unmap."""
    rig = make_rig("batched_large")
    malloc, free = slot(rig.allocator, "runtime")
    p = malloc(4 * G, 0, None)  # type: ignore[operator]
    start = len(rig.driver.calls)
    free(p, 4 * G, 0, None)  # type: ignore[operator]
    calls = [c.call for c in rig.driver.calls[start:]]
    assert "unmap" in calls and "wait" in calls and calls.index("wait") < calls.index("unmap"), calls
    assert rig.driver.used == 0 and rig.allocator.pending_errors() == []


def test_a_free_whose_stream_wait_fails_keeps_the_mapping_and_reports_it(make_rig: RigMaker) -> None:
    """When the wait for the stream fails the segment's mapping stays (no kernel can fault); the error reaches Python; a sleep unmaps it."""
    rig = make_rig("batched_large")
    malloc, free = slot(rig.allocator, "runtime")
    p = malloc(4 * G, 0, None)  # type: ignore[operator]
    rig.driver.fail("wait", reason="stream wait failed on purpose")
    free(p, 4 * G, 0, None)  # type: ignore[operator]
    errors = rig.allocator.pending_errors()
    assert len(errors) == 1 and "stream wait failed on purpose" in str(errors[0]) and errors[0].operation == "free"
    assert rig.driver.used == 4 * G and rig.allocator.usage()["runtime"].allocations == 0
    rig.allocator.backup(["runtime"])
    rig.allocator.release(["runtime"])
    assert rig.driver.used == 0


def test_torchs_malloc_out_of_memory_reclaims_the_tags_pending_segment_after_waiting_for_its_stream(
    make_rig: RigMaker,
) -> None:
    """A malloc of a tag with no device memory left waits for the stream of the tag's pending free segment, trims it and succeeds; every byte of the new block is right and the trim is reported once."""
    rig = make_rig("batched_large", capacity=10 * G, slab_bytes=0)
    malloc, free = slot(rig.allocator, "scratch")
    first = malloc(6 * G, 0, None)  # type: ignore[operator]
    assert first
    assert rig.allocator._table.pend(first, 0x1234)  # freed in torch while a kernel on stream 0x1234 was queued
    waits = rig.driver.count("wait")
    second = malloc(8 * G, 0, None)  # type: ignore[operator]
    assert second, rig.allocator.pending_errors()
    assert rig.driver.count("wait") == waits + 1
    data = os.urandom(8 * G)
    rig.allocator.write(second, data)
    assert rig.allocator.read(second, 8 * G) == data
    assert rig.allocator._table.trim(first) is True  # reported to the pool's owner once: it maps it again before reuse
    assert rig.allocator._table.unpend(first) is False
    free(first, 6 * G, 0, None)  # type: ignore[operator]
    free(second, 8 * G, 0, None)  # type: ignore[operator]
    assert rig.allocator.pending_errors() == [] and rig.driver.used == 0


def test_an_allocation_out_of_memory_keeps_a_segment_no_longer_pending_and_raises(make_rig: RigMaker) -> None:
    """A segment unpended (its pool serves a block again) is not reclaimed: the allocation raises AllocatorOutOfMemory and the segment stays mapped."""
    rig = make_rig("batched_large", capacity=10 * G, slab_bytes=0)
    first = rig.allocator.allocate(6 * G, "scratch")
    assert rig.allocator._table.pend(first, 0x1234)
    assert rig.allocator._table.unpend(first) is False
    with pytest.raises(AllocatorOutOfMemory, match="scratch"):
        rig.allocator.allocate(8 * G, "scratch")
    rig.allocator.write(first, b"still mapped")
    rig.allocator.free(first)
