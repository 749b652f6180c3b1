"""torpor.keeper.pinnedcopy: a kept backup's regions pinned in pieces on threads, copies waiting only for their pieces."""

from __future__ import annotations

import ctypes
import random
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from torpor.keeper.pinnedcopy import PinnedPieces, copy_into

PIECE = 4096


class Backup:
    """Two host regions (ctypes buffers) and tensors laid out in them, some across piece boundaries."""

    def __init__(self, sizes: dict[str, int], seed: int = 0) -> None:
        rng = random.Random(seed)
        total = sum(sizes.values())
        half = (total // 2 // PIECE + 1) * PIECE
        self.buffers = [ctypes.create_string_buffer(half), ctypes.create_string_buffer(total - half + PIECE)]
        self.regions = [(ctypes.addressof(b), len(b)) for b in self.buffers]
        self.expected: dict[str, bytes] = {}
        self._segments: dict[str, list[tuple[int, int, int]]] = {}
        region, offset = 0, 0
        for name, n in sizes.items():
            data = bytes(rng.randrange(256) for _ in range(n))
            self.expected[name] = data
            parts, at = [], 0
            while at < n:
                base, size = self.regions[region]
                take = min(n - at, size - offset)
                if take == 0:
                    region, offset = region + 1, 0
                    continue
                ctypes.memmove(base + offset, data[at : at + take], take)
                parts.append((base + offset, take, at))
                offset, at = offset + take, at + take
            self._segments[name] = parts

    def segments(self, name: str) -> Iterator[tuple[int, int, int]]:
        yield from self._segments[name]


SIZES = {"embed": 3 * PIECE + 100, "w1": 2 * PIECE, "norm": 77, "w2": 5 * PIECE - 1, "head": PIECE + 3}


def _tensors(sizes: dict[str, int]) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.zeros(n, dtype=torch.uint8)) for name, n in sizes.items()]


class Pins:
    """Recording pin and unpin calls from any thread, each pin taking a random few milliseconds."""

    def __init__(self, fail: set[int] | None = None, raise_on: set[int] | None = None) -> None:
        self.lock = threading.Lock()
        self.pinned: list[tuple[int, int]] = []
        self.unpinned: list[tuple[int, int]] = []
        self.fail, self.raise_on = fail or set(), raise_on or set()
        self.threads: set[str] = set()

    def pin(self, address: int, n: int) -> bool:
        time.sleep(random.uniform(0, 0.003))
        with self.lock:
            self.threads.add(threading.current_thread().name)
            index = len(self.pinned)
            self.pinned.append((address, n))
        if index in self.raise_on:
            raise OSError("pin failed")
        return index not in self.fail

    def unpin(self, address: int, n: int) -> None:
        with self.lock:
            self.unpinned.append((address, n))


def test_every_byte_arrives_and_each_piece_is_pinned_once_and_unpinned_after() -> None:
    """Copies in host order from pieces pinned on four threads: every tensor's bytes, every piece unpinned on release."""
    backup, pins = Backup(SIZES), Pins()
    pieces = PinnedPieces(backup.regions, pins.pin, pins.unpin, threads=4, piece_bytes=PIECE)
    tensors = _tensors(SIZES)
    assert copy_into(backup, tensors, pieces) == sum(SIZES.values())
    pieces.release()
    for name, t in tensors:
        assert t.numpy().tobytes() == backup.expected[name], name
    expected = sorted((b + o, min(PIECE, n - o)) for b, n in backup.regions for o in range(0, n, PIECE))
    assert sorted(pins.pinned) == expected and sorted(pins.unpinned) == expected
    assert pieces.pieces == len(expected) and len(pins.threads) > 1


def test_a_piece_whose_pin_fails_is_copied_as_pageable_and_not_unpinned() -> None:
    """A pin that returns False or raises: the bytes under it still arrive, pinned() says False there, no unpin of it."""
    backup, pins = Backup(SIZES, seed=1), Pins(fail={1}, raise_on={3})
    pieces = PinnedPieces(backup.regions, pins.pin, pins.unpin, threads=1, piece_bytes=PIECE)
    tensors = _tensors(SIZES)
    copy_into(backup, tensors, pieces)
    failed = [pins.pinned[1], pins.pinned[3]]
    assert not pieces.pinned(failed[0][0], 1) and not pieces.pinned(failed[1][0] + 5, 10)
    good = next(p for i, p in enumerate(pins.pinned) if i not in (1, 3))
    assert pieces.pinned(good[0], good[1])
    pieces.release()
    for name, t in tensors:
        assert t.numpy().tobytes() == backup.expected[name], name
    assert sorted(pins.unpinned) == sorted(p for i, p in enumerate(pins.pinned) if i not in (1, 3))


def test_a_copy_waits_for_the_pins_of_its_own_pieces_only() -> None:
    """pinned() returns for a range whose pieces are pinned while a later piece's pin still blocks, then waits for it."""
    backup = Backup({"a": 4 * PIECE})
    gate = threading.Event()
    first, *_ = backup.regions

    def pin(address: int, n: int) -> bool:
        if address >= first[0] + 2 * PIECE and address < first[0] + first[1]:
            gate.wait(10)
        return True

    pieces = PinnedPieces(backup.regions, pin, lambda a, n: None, threads=8, piece_bytes=PIECE)
    assert pieces.pinned(first[0], 2 * PIECE)  # the first two pieces: not held by the gate
    waited: list[bool] = []
    t = threading.Thread(target=lambda: waited.append(pieces.pinned(first[0] + PIECE, 2 * PIECE)))
    t.start()
    t.join(0.2)
    assert t.is_alive() and not waited  # the third piece is still being pinned
    gate.set()
    t.join(5)
    assert waited == [True]
    pieces.release()


def test_a_range_outside_every_region_is_not_pinned() -> None:
    """Bytes below, between or past the regions are never reported pinned."""
    backup = Backup({"a": 2 * PIECE})
    pieces = PinnedPieces(backup.regions, lambda a, n: True, lambda a, n: None, threads=2, piece_bytes=PIECE)
    (a0, n0), (a1, n1) = sorted(backup.regions)
    assert not pieces.pinned(a0 - PIECE, 10)
    assert not pieces.pinned(a1 + n1, 10)
    assert a0 + n0 < a1  # two separate buffers: a gap between them
    assert not pieces.pinned(a0 + n0 - 1, 2)  # from the first region's last byte into the gap
    pieces.release()


def test_nonpositive_pieces_or_threads_are_refused() -> None:
    """A zero piece size or thread count is refused with both values named."""
    with pytest.raises(ValueError, match="piece_bytes=0 and threads=1"):
        PinnedPieces([], lambda a, n: True, lambda a, n: None, threads=1, piece_bytes=0)
    with pytest.raises(ValueError, match="threads=0"):
        PinnedPieces([], lambda a, n: True, lambda a, n: None, threads=0)


def test_each_piece_is_populated_just_before_its_pin_on_the_same_thread() -> None:
    """With populate given, every piece is faulted in first, by the thread that then pins it."""
    backup = Backup(SIZES, seed=2)
    lock, events = threading.Lock(), []

    def populate(address: int, n: int) -> None:
        with lock:
            events.append(("populate", address, threading.get_ident()))

    def pin(address: int, n: int) -> bool:
        with lock:
            events.append(("pin", address, threading.get_ident()))
        return True

    pieces = PinnedPieces(backup.regions, pin, lambda a, n: None, threads=3, piece_bytes=PIECE, populate=populate)
    copy_into(backup, _tensors(SIZES), pieces)
    pieces.release()
    for _, address, thread in [e for e in events if e[0] == "pin"]:
        before = [e for e in events[: events.index(("pin", address, thread))] if e[1] == address]
        assert before == [("populate", address, thread)], address
    assert len(events) == 2 * pieces.pieces


def test_populating_a_kept_region_keeps_its_bytes() -> None:
    """shmem.populate faults a memfd region in without changing a byte of it (never a write of zeros)."""
    import os

    from torpor.keeper import shmem

    n = 4 * 1024 * 1024
    fd = shmem.create_region("test-populate", n)
    try:
        writer = shmem.map_anywhere(fd, n)
        data = bytes(random.Random(3).randrange(256) for _ in range(4096)) * (n // 4096)
        ctypes.memmove(writer, data, n)
        reader = shmem.map_anywhere(fd, n)
        try:
            assert shmem.populate(reader, n)  # Linux 5.14 or later (MADV_POPULATE_WRITE)
            assert ctypes.string_at(reader, n) == data
        finally:
            shmem.unmap(reader, n)
            shmem.unmap(writer, n)
    finally:
        os.close(fd)


class _Short(Backup):
    """A backup whose manifest for ``w1`` covers 16 of its bytes: the rest would stay the new model's values."""

    def segments(self, name: str) -> Iterator[tuple[int, int, int]]:
        if name == "w1":
            host, _, at = self._segments[name][0]
            yield host, 16, at
            return
        yield from super().segments(name)


def test_segments_that_do_not_cover_a_tensor_exactly_are_refused_before_any_copy() -> None:
    """copy_into refuses a tensor whose segments cover 16 of its bytes, naming it, and copies nothing."""
    backup = _Short(SIZES)
    tensors = _tensors(SIZES)
    with pytest.raises(ValueError, match=r"tensor 'w1': the backup covers 16 of its 8192 bytes"):
        copy_into(backup, tensors)
    assert all(not t.any() for _, t in tensors)
