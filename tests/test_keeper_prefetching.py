"""Prefetching a kept backup as an engine starts: claimed and pinned before the model is built, taken over by adopt."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from keeper_engine import SOURCE, running_keeper, start_engine, tiny_model

from torpor.errors import PinningUnavailable
from torpor.keeper import AdoptionRefused, KeeperLink, adopt, claim_backup, prefetch, wait_released
from torpor.keeper import prefetching as prefetch_module
from torpor.keeper.prefetching import Pinned, taken


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Path]:
    """A keeper process at a socket of its own; killed after the test (and any prefetch left over let go)."""
    sock = tmp_path / "keeper" / "keeper.sock"
    with running_keeper(sock):
        yield sock
    for engine in ("p0", "p1", "p2", "p3", "p4"):
        left = taken(sock, engine)
        if left is not None:
            left.close()


def _dead_engine(keeper: Path, engine: str, seed: int) -> None:
    proc, _ = start_engine(keeper, engine, seed)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _same(model: torch.nn.Module, seed: int) -> None:
    want = tiny_model(seed)
    for (name, got), (_, ref) in zip(model.state_dict().items(), want.state_dict().items(), strict=True):
        assert torch.equal(got, ref), name


class FakePinning:
    """HostPinning's calls, recorded with the calling thread's name."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.calls: list[tuple[str, int, str]] = []
        made.append(self)

    def pin(self, address: int, nbytes: int) -> bool:
        self.calls.append(("pin", address, threading.current_thread().name))
        return True

    def unpin(self, address: int, _nbytes: int) -> int:
        self.calls.append(("unpin", address, threading.current_thread().name))
        return 0

    def close(self) -> None:
        self.calls.append(("close", self.device, threading.current_thread().name))


made: list[FakePinning] = []


def test_a_prefetched_backup_is_taken_over_by_adopt(keeper: Path) -> None:
    """prefetch() before the model exists; adopt() fills the model from it (every tensor), then the keeper drops it."""
    _dead_engine(keeper, "p0", 3)
    held = prefetch(keeper=keeper, engine="p0")
    assert held is not None and prefetch(keeper=keeper, engine="p0") is held  # asked twice: the same claim
    model = tiny_model(21)
    adopted = adopt(model, source=SOURCE, keeper=keeper, engine="p0")
    assert adopted is not None and adopted.backup == held.kept.id
    _same(model, 3)
    assert taken(keeper, "p0") is None  # handed over once
    assert wait_released(30)
    assert KeeperLink(keeper).status()["backups"] == []


def test_with_nothing_kept_prefetch_says_why_and_adopt_falls_back(
    keeper: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No backup: prefetch returns None and logs the keeper's reason; adopt then loads the normal way."""
    caplog.set_level("INFO", logger="torpor.keeper")
    assert prefetch(keeper=keeper, engine="p1") is None
    assert "nothing prefetched from the keeper" in caplog.text and "holds no backup" in caplog.text
    loaded: list[int] = []
    assert adopt(tiny_model(1), source=SOURCE, keeper=keeper, engine="p1", fallback=lambda: loaded.append(1)) is None
    assert loaded == [1]


def test_a_prefetch_of_another_model_is_refused_at_adopt_and_let_go(keeper: Path) -> None:
    """adopt() with another source raises the keeper's reason; the claim goes and the right model adopts after."""
    _dead_engine(keeper, "p2", 4)
    assert prefetch(keeper=keeper, engine="p2") is not None
    with pytest.raises(AdoptionRefused, match="the backup is of 'tests/tiny-model@1', this process built 'other'"):
        adopt(tiny_model(4), source="other", keeper=keeper, engine="p2")
    assert taken(keeper, "p2") is None
    model = tiny_model(9)
    assert adopt(model, source=SOURCE, keeper=keeper, engine="p2") is not None
    _same(model, 4)


def test_pins_run_on_the_pool_and_unpins_after_adoption_off_the_callers_thread(
    keeper: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a GPU, each piece is pinned on a pinning thread; closing later unpins on another thread, then releases."""
    made.clear()
    monkeypatch.setattr(prefetch_module, "HostPinning", FakePinning)
    _dead_engine(keeper, "p3", 5)
    held = Pinned(claim_backup(keeper=keeper, engine="p3"), device=2, threads=2)
    assert held.pieces is not None and held.pieces.pieces >= 1
    held.close_later()
    assert wait_released(30)
    held.close()  # again: nothing more happens
    (pinning,) = made
    assert pinning.device == 2
    pins = [c for c in pinning.calls if c[0] == "pin"]
    unpins = [c for c in pinning.calls if c[0] == "unpin"]
    assert len(pins) == len(unpins) == held.pieces.pieces
    assert {c[2] for c in pins} <= {"torpor-adopt-pin_0", "torpor-adopt-pin_1"}
    assert pinning.calls[-1][0] == "close" and pinning.calls[-1][2] == "torpor-adopt-release"
    assert threading.current_thread().name not in {c[2] for c in pinning.calls}


def test_a_gpu_the_driver_cannot_pin_for_is_copied_pageable(
    keeper: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When the CUDA driver gives no context, the regions stay mapped unpinned (logged) and still read back whole."""

    def unavailable(device: int) -> None:
        raise PinningUnavailable(f"no context for GPU {device}")

    monkeypatch.setattr(prefetch_module, "HostPinning", unavailable)
    _dead_engine(keeper, "p4", 6)
    held = prefetch(keeper=keeper, engine="p4", device=0)
    assert held is not None and held.pieces is None
    assert "are not pinned (no context for GPU 0)" in caplog.text
    model = tiny_model(2)
    assert adopt(model, source=SOURCE, keeper=keeper, engine="p4") is not None
    _same(model, 6)


def test_a_keeper_that_dies_after_the_prefetch_makes_adopt_fall_back_and_let_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The keeper killed between prefetch and adopt: adopt logs why and loads the normal way; the claim is closed."""
    sock = tmp_path / "dies" / "keeper.sock"
    with running_keeper(sock) as proc:
        _dead_engine(sock, "p5", 7)
        held = prefetch(keeper=sock, engine="p5")
        assert held is not None
        proc.kill()
        proc.wait()
        loaded: list[int] = []
        model = tiny_model(8)
        assert adopt(model, source=SOURCE, keeper=sock, engine="p5", fallback=lambda: loaded.append(1)) is None
    assert loaded == [1] and "nothing adopted" in caplog.text and "stopped answering" in caplog.text
    assert taken(sock, "p5") is None and held.kept.regions() == []  # handed over, then closed: nothing mapped
    _same(model, 8)  # the fallback's business: the model is untouched by the keeper
