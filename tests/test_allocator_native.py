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

from torpor.allocator import AllocatorError, AllocatorOutOfMemory, SimDriver, TaggedAllocator
from torpor.allocator.native import library as native
from torpor.testrig import sim_rig

G = 64 * 1024
MiB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


def make(capacity: int = 256 * MiB, slab_bytes: int = 8 * G) -> tuple[SimDriver, TaggedAllocator]:
    """torpor.testrig's rig: a simulated device with 64 KiB granules and an allocator on it."""
    rig = sim_rig(capacity, granularity=G, group_bytes=4 * G, piece_bytes=2 * G, slab_bytes=slab_bytes)
    return rig.driver, rig.allocator


def slot(alloc: TaggedAllocator, tag: str) -> tuple[object, object]:
    """The malloc/free pair torch would get for ``tag``, callable from Python (ctypes drops the GIL around them)."""
    alloc.tag_state(tag)
    m, f = alloc.table.slot(tag)
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


def test_slots_allocate_and_free_in_their_tags_from_any_thread() -> None:
    """Frees route by slot, not by thread: four threads allocate in four tags, others free them, bookkeeping stays exact."""
    sim, alloc = make()
    pairs = {f"t{i}": slot(alloc, f"t{i}") for i in range(4)}
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
    assert sum(alloc.usage()[t].allocations for t in pairs) == 800
    random.Random(1).shuffle(made)

    def free(part: list[tuple[str, int]]) -> None:
        for tag, p in part:
            pairs[tag][1](p, 0, 0, None)  # type: ignore[operator]

    threads = [threading.Thread(target=free, args=(made[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(alloc.usage()[t].allocations == 0 for t in pairs)
    assert sim.used == 0 and sim.mapped_ranges() == [] and alloc.pending_errors() == []


def test_threads_allocate_while_another_sleeps_and_wakes_their_neighbour() -> None:
    """Threads malloc/free in their tags while the main thread backs up, releases and restores another tag: every byte kept."""
    sim, alloc = make(capacity=1 << 30)
    data = {alloc.allocate(n, "weights"): os.urandom(n) for n in (G, 3 * G, 5 * G, G)}
    for a, b in data.items():
        alloc.write(a, b)
    pairs = {f"w{i}": slot(alloc, f"w{i}") for i in range(4)}
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
        alloc.backup(["weights"])
        alloc.release(["weights"])
        alloc.restore(["weights"])
        alloc.drop_backup(["weights"])
        assert all(alloc.read(a, len(b)) == b for a, b in data.items())
    stop.set()
    for t in threads:
        t.join()
    assert not failures and alloc.pending_errors() == []
    assert all(alloc.usage()[t].allocations == 0 for t in pairs)
    assert sim.used == sum(alloc.size_of(a) for a in data)


def test_failed_malloc_returns_null_and_the_reason_reaches_python() -> None:
    """An out-of-memory malloc returns NULL (nothing raised in C); pending_errors() gives the reason as AllocatorOutOfMemory."""
    sim, alloc = make()
    malloc, _ = slot(alloc, "kv_cache")
    sim.fail("create", oom=True)
    assert not malloc(4 * G, 0, None)  # type: ignore[operator]
    errors = alloc.pending_errors()
    assert len(errors) == 1 and isinstance(errors[0], AllocatorOutOfMemory)
    assert errors[0].tag == "kv_cache" and errors[0].operation == "allocate" and "out of memory" in str(errors[0])
    assert alloc.pending_errors() == [] and sim.used == 0


def test_one_granule_allocations_share_slabs_that_double() -> None:
    """One-granule allocations fill slabs of 2, 4, 8 granules (one driver map each); larger ones get their own mapping."""
    sim, alloc = make(slab_bytes=8 * G)
    for _ in range(2 + 4 + 8 + 8):
        alloc.allocate(G, "w")
    assert sim.count("map") == 4 and alloc.slabs.count() == 4 and alloc.slabs.spare_bytes() == 0
    alloc.allocate(2 * G, "w")
    assert sim.count("map") == 5


def test_a_granule_freed_in_a_slab_is_reused_and_the_last_free_unmaps_the_slab() -> None:
    """A freed slab granule is taken by the next one-granule allocation without a driver call; the slab goes with its last user."""
    sim, alloc = make()
    a, b = alloc.allocate(G, "w"), alloc.allocate(G, "w")
    alloc.free(a)
    maps = sim.count("map")
    assert alloc.allocate(G, "w") == a and sim.count("map") == maps
    alloc.free(a)
    alloc.free(b)
    assert alloc.slabs.count() == 0 and sim.used == 0 and sim.mapped_ranges() == []


def test_frees_during_a_sleep_keep_mappings_until_the_release() -> None:
    """Between backup and release a free unmaps nothing (copies may be in flight); the release takes it all, the wake skips it."""
    sim, alloc = make()
    a, b = alloc.allocate(2 * G, "w"), alloc.allocate(2 * G, "w")
    alloc.write(b, b"k" * 2 * G)
    alloc.backup(["w"])
    unmaps = sim.count("unmap")
    alloc.free(a)
    assert sim.count("unmap") == unmaps and alloc.usage()["w"].allocations == 1
    alloc.release(["w"])
    assert sim.used == 0
    alloc.restore(["w"])
    assert sim.used == 2 * G and alloc.read(b, 2 * G) == b"k" * 2 * G


def test_a_called_off_sleep_unmaps_what_was_freed_meanwhile() -> None:
    """A backup dropped without a release thaws the tag: mappings freed while frozen go then."""
    sim, alloc = make()
    a = alloc.allocate(2 * G, "w")
    alloc.allocate(2 * G, "w")
    alloc.backup(["w"])
    alloc.free(a)
    assert sim.used == 4 * G
    alloc.drop_backup(["w"])
    assert sim.used == 2 * G and alloc.allocate(G, "w")


def test_more_than_sixty_four_tags_is_a_clear_error() -> None:
    """The table holds 64 tags; the 65th is refused with a reason, not a crash."""
    _, alloc = make()
    for i in range(64):
        alloc.tag_state(f"t{i}")
    with pytest.raises(AllocatorError, match="at most 64 tags"):
        alloc.allocate(G, "one-too-many")


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


def test_every_slot_routes_to_its_own_tag() -> None:
    """Forty tags get forty slots; each slot's malloc lands in its own tag (slots are numbered 0..127, none skipped)."""
    _, alloc = make()
    pairs = {f"s{i}": slot(alloc, f"s{i}") for i in range(40)}
    for malloc, _ in pairs.values():
        assert malloc(G, 0, None)  # type: ignore[operator]
    assert all(alloc.usage()[t].allocations == 1 for t in pairs)


def test_release_again_on_a_kept_backup_refuses_allocations_made_after_it() -> None:
    """After a wake the backup is kept: releasing on it works, unless an allocation was made since (it has no backup)."""
    sim, alloc = make()
    a = alloc.allocate(2 * G, "w")
    alloc.write(a, b"q" * 2 * G)
    alloc.backup(["w"])
    alloc.release(["w"])
    alloc.restore(["w"])
    alloc.release(["w"])  # a failed wake's rollback does this
    assert sim.used == 0
    alloc.restore(["w"])
    assert alloc.read(a, 2 * G) == b"q" * 2 * G
    alloc.allocate(G, "w")
    with pytest.raises(AllocatorError, match="made after its backup"):
        alloc.release(["w"])
    assert alloc.usage()["w"].resident == 3 * G


def test_trim_gives_a_segment_back_but_keeps_its_address_until_torch_frees_it() -> None:
    """A trimmed segment's memory goes at once; usage no longer counts it; its address is not reused before the free."""
    sim, alloc = make()
    a = alloc.allocate(2 * G, "w")
    b = alloc.allocate(2 * G, "w")
    assert alloc.table.trim(a) is True
    assert alloc.table.trim(a) is False  # idempotent: trimmed already
    assert sim.used == 2 * G and alloc.usage()["w"].allocations == 1 and alloc.usage()["w"].resident == 2 * G
    c = alloc.allocate(2 * G, "w")
    assert c not in (a, b)
    alloc.free(a)  # torch drops the pool: the record goes, the address is free again
    assert alloc.allocate(2 * G, "w") == a


def test_a_trimmed_slab_granule_is_not_handed_out_before_torch_frees_it() -> None:
    """Inside a slab a trimmed granule stays taken (torch still holds it); freed, it is spare again."""
    _, alloc = make(slab_bytes=8 * G)
    first, second = alloc.allocate(G, "w"), alloc.allocate(G, "w")
    alloc.table.trim(first)
    third = alloc.allocate(G, "w")
    assert third not in (first, second) and alloc.slabs.count() == 2
    alloc.free(first)
    assert alloc.allocate(G, "w") == first


def test_a_sleep_trims_nothing_torch_holds_live_and_skips_trimmed_segments() -> None:
    """A trimmed segment is neither backed up nor mapped back on wake; the live ones come back bit-exact."""
    sim, alloc = make()
    a, b = alloc.allocate(2 * G, "w"), alloc.allocate(2 * G, "w")
    alloc.write(b, b"b" * 2 * G)
    alloc.table.trim(a)
    moved = alloc.backup(["w"])["w"].bytes
    alloc.release(["w"])
    alloc.restore(["w"])
    assert moved == 2 * G and sim.used == 2 * G and alloc.read(b, 2 * G) == b"b" * 2 * G


def test_untrim_maps_a_trimmed_segment_again_and_counts_it() -> None:
    """A trimmed segment untrimmed (its pool serves a block again) is mapped, counted and writable; untrim again says no."""
    sim, alloc = make()
    a = alloc.allocate(2 * G, "w")
    alloc.table.trim(a)
    assert sim.used == 0 and alloc.usage()["w"].allocations == 0
    assert alloc.table.untrim(a) is True
    assert sim.used == 2 * G and alloc.usage()["w"].resident == 2 * G
    alloc.write(a, b"x" * 2 * G)
    assert alloc.read(a, 2 * G) == b"x" * 2 * G
    assert alloc.table.untrim(a) is False
    alloc.free(a)
    assert sim.used == 0


def test_untrim_of_a_slab_granule_counts_it_on_the_live_slab() -> None:
    """A trimmed granule of a slab still mapped becomes a user again: freeing its neighbour keeps the slab mapped."""
    sim, alloc = make(slab_bytes=8 * G)
    first, second = alloc.allocate(G, "w"), alloc.allocate(G, "w")
    alloc.table.trim(first)
    assert alloc.table.untrim(first)
    mapped = sim.used
    alloc.free(second)
    assert sim.used == mapped and alloc.usage()["w"].allocations == 1
    alloc.free(first)
    assert sim.used == 0


def test_untrim_while_asleep_is_refused_and_the_segment_stays_trimmed() -> None:
    """Untrimming in a released tag raises AllocatorError; after the wake it works and the live data is intact."""
    sim, alloc = make()
    a, b = alloc.allocate(2 * G, "w"), alloc.allocate(2 * G, "w")
    alloc.write(b, b"b" * 2 * G)
    alloc.table.trim(a)
    alloc.backup(["w"])
    alloc.release(["w"])
    with pytest.raises(AllocatorError, match="asleep"):
        alloc.table.untrim(a)
    alloc.restore(["w"])
    alloc.drop_backup(["w"])
    assert alloc.table.untrim(a) and sim.used == 4 * G
    assert alloc.read(b, 2 * G) == b"b" * 2 * G


def test_trim_of_a_tag_going_to_sleep_waits_and_of_a_released_tag_keeps_the_wake_off_it() -> None:
    """Frozen for a sleep: trim returns False and leaves the record; released: trim takes it, the wake maps nothing of it, untrim maps it again."""
    sim, alloc = make()
    a = alloc.allocate(2 * G, "w")
    alloc.backup(["w"])
    assert alloc.table.trim(a) is False  # its backup is in flight: the release takes it
    alloc.release(["w"])
    assert alloc.table.trim(a) is True and sim.used == 0  # a segment torch holds free while the tag is asleep
    alloc.restore(["w"])
    alloc.drop_backup(["w"])
    assert sim.used == 0 and alloc.usage()["w"].allocations == 0
    assert alloc.table.untrim(a) is True and sim.used == 2 * G  # its pool serves a block again
    alloc.free(a)
    assert sim.used == 0


def test_a_trim_whose_unmap_fails_is_a_trim_and_the_mapping_goes_at_the_next_sleep(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Unmap failing at trim: trim says True (torch's side must record it), logs the failure; the sleep unmaps it later."""
    sim, alloc = make()
    a, b = alloc.allocate(2 * G, "w"), alloc.allocate(2 * G, "w")
    alloc.write(b, b"b" * 2 * G)
    sim.fail("unmap", reason="the context is broken")
    with caplog.at_level("WARNING", logger="torpor.allocator"):
        assert alloc.table.trim(a) is True
    assert "the context is broken" in caplog.text and "stays mapped" in caplog.text
    assert alloc.table.trim(a) is False and alloc.usage()["w"].allocations == 1
    moved = alloc.backup(["w"])["w"].bytes
    alloc.release(["w"])
    assert moved == 2 * G and sim.used == 0  # the mapping left by the trim went with the sleep
    alloc.restore(["w"])
    alloc.drop_backup(["w"])
    assert alloc.table.untrim(a) is True and sim.used == 4 * G
    alloc.write(a, b"a" * 2 * G)
    assert alloc.read(a, 2 * G) == b"a" * 2 * G and alloc.read(b, 2 * G) == b"b" * 2 * G


def test_untrim_failing_to_map_changes_nothing() -> None:
    """A device full at untrim: AllocatorError (out of memory), the segment stays trimmed and uncounted."""
    sim, alloc = make()
    a = alloc.allocate(2 * G, "w")
    alloc.table.trim(a)
    sim.fail("create", oom=True)
    with pytest.raises(AllocatorError):
        alloc.table.untrim(a)
    assert sim.used == 0 and alloc.usage()["w"].allocations == 0
    assert alloc.table.untrim(a)


def test_untrim_is_all_or_nothing_when_the_table_cannot_grow() -> None:
    """Host out of memory growing the mapping table at untrim: nothing changes (no user counted twice); nothing leaks after."""
    sim, alloc = make(slab_bytes=0)
    a, x, b = alloc.allocate(G, "w"), alloc.allocate(4 * G, "w"), alloc.allocate(G, "w")
    assert (x, b) == (a + G, a + 5 * G)  # adjacent: the wake maps them in shared spans
    alloc.write(b, b"b" * G)
    alloc.backup(["w"])
    alloc.release(["w"])
    alloc.restore(["w"])  # spans of <= 4 G in 2 G pieces: [a, x's first half], [x's second half, b]
    alloc.drop_backup(["w"])
    assert alloc.table.trim(x)
    alloc.free(a)  # the first span goes: x lies half over nothing, half over the span it shares with b
    native.lib().tp_test_fail_growth(1)
    try:
        with pytest.raises(AllocatorError, match="out of host memory"):
            alloc.table.untrim(x)
    finally:
        native.lib().tp_test_fail_growth(0)
    assert sim.used == 3 * G and alloc.usage()["w"].allocations == 1  # as before: the span x shares with b
    assert alloc.table.untrim(x) and sim.used == 5 * G
    alloc.free(x)
    alloc.free(b)
    assert sim.used == 0 and alloc.usage()["w"].allocations == 0


def test_sleep_copies_only_the_blocks_in_use_and_wake_restores_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """With half of each segment free in torch's pool, the backup moves half the bytes and the live halves come back."""
    sim = SimDriver(256 * MiB, granularity=G)
    alloc = TaggedAllocator(sim, group_bytes=4 * G, piece_bytes=2 * G, slab_bytes=0)

    def half_live(tag: str) -> dict[int, list[tuple[int, int]]]:  # the torch side says half of each is in use
        return {a: [(a, n // 2)] for a, n, _ in alloc.table.allocations(tag)}

    monkeypatch.setattr(alloc.torch_binding, "live_ranges", half_live)
    data = {}
    for _ in range(6):
        a = alloc.allocate(4 * G, "w")
        data[a] = os.urandom(4 * G)
        alloc.write(a, data[a])
    moved = alloc.backup(["w"])["w"].bytes
    copied = sum(c.call == "copy_d2h" for c in sim.calls)
    alloc.release(["w"])
    assert moved == 12 * G and sim.used == 0 and copied >= 1
    alloc.restore(["w"])
    assert all(alloc.read(a, 2 * G) == b[: 2 * G] for a, b in data.items())
    assert alloc.host.used_bytes() == 12 * G


def test_an_injected_failure_carries_its_reason_from_the_library_and_from_python() -> None:
    """sim.fail(reason=...) names the failure, for a call the library makes (create) and one Python makes (host_alloc)."""
    sim, alloc = make()
    sim.fail("create", reason="rank 3 is out of luck")
    with pytest.raises(AllocatorError, match="rank 3 is out of luck"):
        alloc.allocate(G, "w")
    sim.fail("host_alloc", oom=True, reason="no pinned memory here")
    with pytest.raises(Exception, match=r"no pinned memory here \(out of memory\)"):
        sim.host_alloc(G)


# -- out-of-range values and unusable names are refused before the C boundary (issue 30) ------------


def test_sizes_addresses_and_devices_that_would_wrap_are_refused_by_value() -> None:
    """allocate(2**64 + 4096), free(2**64 + a), device=2**32 or -1 raise ValueError naming the value; nothing changes."""
    _, alloc = make()
    kept = alloc.allocate(G, "w")
    before = alloc.table.allocations()
    for nbytes in (2**64 + 4096, 2**64, 2**63):
        with pytest.raises(ValueError, match=f"cannot allocate {nbytes} bytes") as caught:
            alloc.allocate(nbytes, "w")
        assert isinstance(caught.value, AllocatorError)
    for device in (2**32, 2**31, -1, 64):
        with pytest.raises(ValueError, match=rf"device {device}\b"):
            alloc.allocate(G, "w", device=device)
    for address in (2**64 + kept, -kept):
        with pytest.raises(ValueError, match=f"address {address:#x}"):
            alloc.free(address)
        with pytest.raises(ValueError, match="address"):
            alloc.table.trim(address)
    with pytest.raises(ValueError, match="an integer"):
        alloc.allocate(True, "w")  # type: ignore[arg-type]
    assert alloc.table.allocations() == before
    alloc.free(kept)  # the allocation a wrapped address named is still there
    alloc.close()


@pytest.mark.parametrize(
    "tag", ["weights\x00shadow", "", "x" * 64, "\u00e9" * 32, "tab\there", "bad\ud800", b"weights", 7]
)
def test_unusable_tag_names_are_refused_by_name(tag: object) -> None:
    """A tag with a NUL (it would share 'weights''s native slot), empty, over 63 UTF-8 bytes, with a control character or not a str is refused."""
    _, alloc = make()
    alloc.allocate(G, "weights")
    with pytest.raises(ValueError, match="tag") as caught:
        alloc.tag_state(tag)  # type: ignore[arg-type]
    assert isinstance(caught.value, AllocatorError)
    with pytest.raises(ValueError, match="tag"):
        alloc.allocate(G, tag)  # type: ignore[arg-type]
    assert set(alloc.usage()) == {"weights"} and alloc.usage()["weights"].allocations == 1
    alloc.close()


def test_tag_names_up_to_63_utf8_bytes_are_fine() -> None:
    """Names of 63 UTF-8 bytes, non-ASCII or with spaces, are ordinary tags."""
    _, alloc = make()
    for tag in ("x" * 63, "\u00e9" * 31 + "x", "kv cache", "\u6743\u91cd"):
        alloc.allocate(G, tag)
    assert all(u.allocations == 1 for u in alloc.usage().values()) and len(alloc.usage()) == 4
    alloc.close()


# -- torch's slots: reused once their allocator is closed and nothing can call them ---------------------


def _bind_all(n_allocators: int, tags: int = 5) -> set[int]:
    """Build and close ``n_allocators`` allocators that each bind one slot per tag; the malloc addresses they got."""
    seen: set[int] = set()
    for _ in range(n_allocators):
        _, alloc = make(capacity=16 * MiB)
        for i in range(tags):
            alloc.tag_state(f"t{i}")
            seen.add(alloc.table.slot(f"t{i}")[0])
        alloc.close()
    return seen


def test_rebuilding_a_five_tag_allocator_never_runs_out_of_slots() -> None:
    """Sixty rebuilds (300 slot binds, over the 128 slots) succeed: a closed allocator's slots are reused."""
    assert len(_bind_all(60)) <= 128


def test_a_slot_torch_still_holds_memory_through_is_not_reused_until_freed() -> None:
    """A closed allocator's slot with a block torch never freed stays out of reuse (a late free must not reach another allocator)."""
    _, alloc = make(capacity=16 * MiB)
    malloc, free = slot(alloc, "held")
    held = malloc(G, 0, None)  # type: ignore[operator]
    assert held
    address = ctypes.cast(malloc, ctypes.c_void_p).value
    alloc.close()
    assert address not in _bind_all(30)  # 150 binds: every other slot came round again
    free(held, G, 0, None)  # type: ignore[operator]  # torch frees it late (after close): the slot is free now
    assert address in _bind_all(30)


def test_running_out_of_slots_says_who_holds_them() -> None:
    """With every slot bound to an open allocator, the next bind names the 128-slot limit and how many open allocators hold."""
    opened = []
    with pytest.raises(AllocatorError, match=r"128 per process.*bound to open allocators") as caught:
        for _ in range(200):
            _, alloc = make(capacity=16 * MiB)
            opened.append(alloc)
            alloc.tag_state("t")
            alloc.table.slot("t")
    assert "close()" in str(caught.value)
    for alloc in opened:
        alloc.close()
    assert _bind_all(2)  # closing them gave the slots back


def test_a_closed_allocator_reaches_no_torch_pool_and_binds_no_slot() -> None:
    """After close, neither torch's pools of the allocator nor a new slot can be had: its old slots may serve another allocator."""
    _, alloc = make(capacity=16 * MiB)
    alloc.tag_state("w")
    alloc.close()
    with pytest.raises(AllocatorError, match="closed"):
        alloc.torch_binding.pools()
    with pytest.raises(AllocatorError, match="closed"):
        alloc.table.slot("w")


def test_torchs_free_of_a_segment_waits_for_its_stream_before_unmapping() -> None:
    """A segment torch frees (OOM retry, a freed pool) is unmapped only after its stream's queued work: wait, then unmap."""
    sim, alloc = make()
    malloc, free = slot(alloc, "runtime")
    p = malloc(4 * G, 0, None)  # type: ignore[operator]
    start = len(sim.calls)
    free(p, 4 * G, 0, None)  # type: ignore[operator]
    calls = [c.call for c in sim.calls[start:]]
    assert "unmap" in calls and "wait" in calls and calls.index("wait") < calls.index("unmap"), calls
    assert sim.used == 0 and alloc.pending_errors() == []


def test_a_free_whose_stream_wait_fails_keeps_the_mapping_and_reports_it() -> None:
    """When the wait for the stream fails the segment's mapping stays (no kernel can fault); the error reaches Python; a sleep unmaps it."""
    sim, alloc = make()
    malloc, free = slot(alloc, "runtime")
    p = malloc(4 * G, 0, None)  # type: ignore[operator]
    sim.fail("wait", reason="stream wait failed on purpose")
    free(p, 4 * G, 0, None)  # type: ignore[operator]
    errors = alloc.pending_errors()
    assert len(errors) == 1 and "stream wait failed on purpose" in str(errors[0]) and errors[0].operation == "free"
    assert sim.used == 4 * G and alloc.usage()["runtime"].allocations == 0
    alloc.backup(["runtime"])
    alloc.release(["runtime"])
    assert sim.used == 0


def test_torchs_malloc_out_of_memory_reclaims_the_tags_pending_segment_after_waiting_for_its_stream() -> None:
    """A malloc of a tag with no device memory left waits for the stream of the tag's pending free segment, trims it and succeeds; every byte of the new block is right and the trim is reported once."""
    sim, alloc = make(capacity=10 * G, slab_bytes=0)
    malloc, free = slot(alloc, "scratch")
    first = malloc(6 * G, 0, None)  # type: ignore[operator]
    assert first
    assert alloc.table.pend(first, 0x1234)  # freed in torch while a kernel on stream 0x1234 was queued
    waits = sim.count("wait")
    second = malloc(8 * G, 0, None)  # type: ignore[operator]
    assert second, alloc.pending_errors()
    assert sim.count("wait") == waits + 1
    data = os.urandom(8 * G)
    alloc.write(second, data)
    assert alloc.read(second, 8 * G) == data
    assert alloc.table.trim(first) is True  # reported to the pool's owner once: it maps it again before reuse
    assert alloc.table.unpend(first) is False
    free(first, 6 * G, 0, None)  # type: ignore[operator]
    free(second, 8 * G, 0, None)  # type: ignore[operator]
    assert alloc.pending_errors() == [] and sim.used == 0


def test_an_allocation_out_of_memory_keeps_a_segment_no_longer_pending_and_raises() -> None:
    """A segment unpended (its pool serves a block again) is not reclaimed: the allocation raises AllocatorOutOfMemory and the segment stays mapped."""
    _, alloc = make(capacity=10 * G, slab_bytes=0)
    first = alloc.allocate(6 * G, "scratch")
    assert alloc.table.pend(first, 0x1234)
    assert alloc.table.unpend(first) is False
    with pytest.raises(AllocatorOutOfMemory, match="scratch"):
        alloc.allocate(8 * G, "scratch")
    alloc.write(first, b"still mapped")
    alloc.free(first)
