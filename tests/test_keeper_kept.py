"""A kept backup granted to this process: claimed before its model exists, checked later, dropped once adopted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from keeper_engine import ROOT, SOURCE, running_keeper, start_engine, tensor_bytes, tiny_model

from torpor.keeper import AdoptionRefused, KeeperLink, claim_backup, identity_of, open_backup


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Path]:
    """A keeper process at a socket of its own; killed after the test."""
    sock = tmp_path / "keeper" / "keeper.sock"
    with running_keeper(sock):
        yield sock


def _dead_engine(keeper: Path, engine: str, seed: int) -> int:
    proc, _ = start_engine(keeper, engine, seed)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return proc.pid


def _adopter_of(keeper: Path, engine: str) -> object:
    for _ in range(500):
        backups = KeeperLink(keeper).status()["backups"]
        if not backups or backups[0]["adopter"] is None:
            return backups[0]["adopter"] if backups else "none"
        time.sleep(0.01)
    return backups[0]["adopter"]


def test_a_claimed_backup_reads_back_before_its_identity_is_checked(keeper: Path) -> None:
    """claim_backup maps a dead engine's backup with no model at hand; verify() then done() adopt and drop it."""
    pid = _dead_engine(keeper, "c0", 3)
    kept = claim_backup(keeper=keeper, engine="c0")
    try:
        assert kept.from_pid == pid
        model = tiny_model(3)
        for name, data in tensor_bytes(model).items():
            assert bytes(kept.view(name)) == data, name
        kept.verify(identity_of(model, SOURCE))
        assert kept.done().from_pid == pid
    finally:
        kept.close()
    assert KeeperLink(keeper).status()["backups"] == []


def test_adopted_is_refused_until_the_identity_is_checked(keeper: Path) -> None:
    """A claim that was never verified cannot say adopted: the keeper refuses and keeps the backup."""
    _dead_engine(keeper, "c1", 4)
    with claim_backup(keeper=keeper, engine="c1") as kept, pytest.raises(AdoptionRefused, match="claimed, not checked"):
        kept.done()
    assert len(KeeperLink(keeper).status()["backups"]) == 1


def test_a_claim_holds_the_backup_against_another_process(keeper: Path) -> None:
    """While this process holds a claim, another process's adoption is refused naming this pid; closing lets it go."""
    _dead_engine(keeper, "c2", 5)
    probe = (
        "import sys; from keeper_engine import SOURCE, tiny_model\n"
        "from torpor.keeper import AdoptionRefused, identity_of, open_backup\n"
        "try:\n    open_backup(identity_of(tiny_model(5), SOURCE), keeper=sys.argv[1], engine='c2').close()\n"
        "except AdoptionRefused as exc:\n    print(exc)\nelse:\n    print('adopted')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}

    def other() -> str:
        cmd = [sys.executable, "-c", probe, str(keeper)]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=120).stdout

    kept = claim_backup(keeper=keeper, engine="c2")
    assert f"pid {os.getpid()} is adopting it" in other()
    kept.close()
    assert _adopter_of(keeper, "c2") is None
    assert other().strip() == "adopted"


def test_a_mismatch_at_verify_lets_the_claim_go(keeper: Path) -> None:
    """verify() with another model raises the reason and the keeper frees the backup for another adopter."""
    _dead_engine(keeper, "c3", 6)
    with claim_backup(keeper=keeper, engine="c3") as kept:
        assert _adopter_of(keeper, "c3") == os.getpid()
        with pytest.raises(AdoptionRefused, match="the backup is of 'tests/tiny-model@1', this process built 'other'"):
            kept.verify(identity_of(tiny_model(6), "other"))
        assert _adopter_of(keeper, "c3") is None
    model = tiny_model(6)
    with open_backup(identity_of(model, SOURCE), keeper=keeper, engine="c3") as again:
        assert bytes(again.view("up.weight")) == tensor_bytes(model)["up.weight"]


def test_nothing_to_claim_is_refused_with_the_reason(keeper: Path) -> None:
    """Claiming an engine the keeper keeps nothing of raises AdoptionRefused saying so."""
    with pytest.raises(AdoptionRefused, match=r"cannot adopt engine 'nobody'.s backup: the keeper holds no backup"):
        claim_backup(keeper=keeper, engine="nobody")
