"""Adoption from a keeper: an engine process killed with SIGKILL while asleep, a new process takes its backup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from keeper_engine import SOURCE, running_keeper, start_engine, tensor_bytes, tiny_model
from keeper_process import FILL, NOBODY, needs_root, shared_tmp, squatter

from torpor import EventKind, SleepController
from torpor.keeper import AdoptionRefused, KeeperLink, KeeperUntrusted, adopt, identity_of, open_backup
from torpor.testing import FakeMemory


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Path]:
    """A keeper process at a socket of its own; killed after the test."""
    sock = tmp_path / "keeper" / "keeper.sock"
    with running_keeper(sock):
        yield sock


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def test_a_killed_engine_backup_is_adopted_byte_for_byte(keeper: Path, tmp_path: Path) -> None:
    """An engine asleep is SIGKILLed; a new process adopts its backup, reads back every byte, and the log says so."""
    proc, line = start_engine(keeper, "e0", 3)
    assert line["backup"] and line["fallbacks"] == 0 and line["kept_bytes"] > 0
    _kill(proc)
    model = tiny_model(3)
    log = tmp_path / "adopter.log"
    ctl = SleepController(FakeMemory({"weights": 1}), log=log)
    with open_backup(identity_of(model, SOURCE), keeper=keeper, engine="e0") as kept:
        for name, data in tensor_bytes(model).items():
            assert bytes(kept.view(name)) == data, name
        adopted = kept.done(ctl)
    ctl.close()
    assert adopted.from_pid == proc.pid
    assert adopted.bytes == identity_of(model, SOURCE).nbytes
    events = [e for e in _events(log) if e.get("kind") == EventKind.BACKUP_ADOPTED.value]
    assert len(events) == 1, events
    body = json.dumps(events[0])
    assert str(proc.pid) in body and line["backup"] in body
    state = KeeperLink(keeper).status()
    assert state["backups"] == [] and state["used"] == 0, state  # an adopted backup is dropped, its regions closed
    assert state["adoptions"][0]["from_pid"] == proc.pid


def test_adopt_copies_into_a_freshly_built_model(keeper: Path) -> None:
    """torpor.keeper.adopt fills a model built with other values with the dead engine's tensors, buffers included."""
    proc, _ = start_engine(keeper, "e1", 5)
    _kill(proc)
    model = tiny_model(11)
    adopted = adopt(model, source=SOURCE, keeper=keeper, engine="e1")
    assert adopted is not None and adopted.tensors == len(tensor_bytes(model))
    want = tiny_model(5)
    for (name, got), (_, ref) in zip(
        [*model.named_parameters(), *model.named_buffers()],
        [*want.named_parameters(), *want.named_buffers()],
        strict=True,
    ):
        assert torch.equal(got, ref), name


def test_a_mismatched_model_is_refused_with_the_reason(keeper: Path) -> None:
    """Another width or another source is refused, naming what differs; the backup stays for the right model."""
    proc, _ = start_engine(keeper, "e2", 7)
    _kill(proc)
    with pytest.raises(AdoptionRefused, match=r"differ in shape or dtype \(up\.weight: \[1024, 1024\]"):
        open_backup(identity_of(tiny_model(7, width=512), SOURCE), keeper=keeper, engine="e2")
    with pytest.raises(AdoptionRefused, match="the backup is of 'tests/tiny-model@1', this process built 'other'"):
        open_backup(identity_of(tiny_model(7), "other"), keeper=keeper, engine="e2")
    with pytest.raises(AdoptionRefused, match="not in the backup"):
        extra = tiny_model(7)
        extra.extra = torch.nn.Linear(2, 2)
        open_backup(identity_of(extra, SOURCE), keeper=keeper, engine="e2")
    model = tiny_model(1)
    assert adopt(model, source=SOURCE, keeper=keeper, engine="e2") is not None
    assert torch.equal(model.up.weight, tiny_model(7).up.weight)


def test_a_live_engine_backup_is_not_adopted(keeper: Path) -> None:
    """While the process that wrote a backup lives, adoption is refused naming its pid."""
    proc, _ = start_engine(keeper, "e3", 2)
    try:
        with pytest.raises(AdoptionRefused, match=f"pid {proc.pid}, which wrote it, is alive"):
            open_backup(identity_of(tiny_model(2), SOURCE), keeper=keeper, engine="e3")
    finally:
        _kill(proc)


def test_nothing_to_adopt_falls_back_and_says_so(
    keeper: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With no backup kept (or no keeper at all), adopt calls the fallback and logs why."""
    loaded = []
    model = tiny_model(1)
    assert adopt(model, source=SOURCE, keeper=keeper, engine="nobody", fallback=lambda: loaded.append(1)) is None
    gone = tmp_path / "none" / "keeper.sock"
    assert adopt(model, source=SOURCE, keeper=gone, engine="e", fallback=lambda: loaded.append(2)) is None
    assert loaded == [1, 2]
    assert "holds no backup" in caplog.text and "no keeper answers" in caplog.text


@needs_root
def test_an_adopter_loads_nothing_from_another_users_keeper(caplog: pytest.LogCaptureFixture) -> None:
    """Another user's keeper offers a backup of any identity asked for: refused before asking, the fallback loads."""
    model, loaded = tiny_model(5), []
    with shared_tmp() as base, squatter(base / "k") as squat:
        adopted = adopt(model, source=SOURCE, keeper=squat.path, engine="e", fallback=lambda: loaded.append(1))
        assert tensor_bytes(model) == tensor_bytes(tiny_model(5)), f"the model holds the other user's bytes ({FILL:#x})"
        with pytest.raises(KeeperUntrusted, match=f"owner found: uid {NOBODY}"):
            adopt(model, source=SOURCE, keeper=squat.path, engine="e")
    assert squat.heard == [], f"the other user's keeper heard {squat.heard}"
    assert adopted is None and loaded == [1]
    assert f"refused the keeper at {squat.path}" in caplog.text


def test_tensors_whose_backup_spans_two_regions_read_back_whole(keeper: Path) -> None:
    """A backup cut across an old region and a new one (a later sleep needed more) still reads back every byte."""
    proc, _ = start_engine(keeper, "e4", 9, "--split")
    _kill(proc)
    model = tiny_model(9)
    with open_backup(identity_of(model, SOURCE), keeper=keeper, engine="e4") as kept:
        assert len(kept.regions()) >= 2
        assert any(len(list(kept.segments(n))) > 1 for n in kept.names), [list(kept.segments(n)) for n in kept.names]
        for name, data in tensor_bytes(model).items():
            assert bytes(kept.view(name)) == data, name
    fresh = tiny_model(1)
    assert adopt(fresh, source=SOURCE, keeper=keeper, engine="e4") is not None
    for (name, got), (_, ref) in zip(fresh.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(got, ref), name
