"""The keeper's records as engines come and go: a writer found gone before its connection's end is read."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from keeper_process import ROOT

from torpor.keeper import AdoptionRefused, Keeper, KeeperLink
from torpor.keeper.ledger import gone, process_start
from torpor.units import MiB


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Keeper]:
    """A keeper in this process (a thread) with a budget of 8 MiB."""
    k = Keeper(tmp_path / "k" / "keeper.sock", budget_bytes=8 * MiB).start()
    yield k
    k.close()


#: Connect the socket passed as argv[2] to the keeper at argv[1], publish engine argv[3]'s backup, exit once stdin ends.
_PUBLISH_ON_A_SHARED_SOCKET = """
import socket, sys
from torpor.keeper import ModelIdentity, TensorSpec, wire
conn = socket.socket(fileno=int(sys.argv[2]))
conn.connect(sys.argv[1])
def call(op, **fields):
    wire.send(conn, {"op": op, **fields})
    reply, fds = wire.receive(conn)
    assert "error" not in reply, reply
    return reply, fds
call("hello", engine=sys.argv[3])
reply, fds = call("create", nbytes=1 << 20)
identity = ModelIdentity.of("m", [TensorSpec("w", (4096,), "uint8", 4096)])
tensors = {"w": {"segments": [[reply["region"], 0, 4096]]}}
call("publish", identity=identity.to_dict(), nbytes=4096, tensors=tensors)
print("published", flush=True)
sys.stdin.read()  # until the test closes it
"""


@contextlib.contextmanager
def _writer(path: Path, engine: str, held: socket.socket) -> Iterator[subprocess.Popen[str]]:
    """A process that connects ``held`` (its pid is the peer's) and publishes ``engine``'s backup, alive for the block."""
    cmd = [sys.executable, "-c", _PUBLISH_ON_A_SHARED_SOCKET, str(path), str(held.fileno()), engine]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, pass_fds=(held.fileno(),)
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "published"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _writer_gone_connection_open(path: Path, engine: str, held: socket.socket) -> None:
    """A process connects ``held``, publishes ``engine``'s backup and is killed (and reaped); ``held`` stays open here."""
    with _writer(path, engine, held):
        pass


def test_a_claim_goes_through_once_the_writer_is_gone_though_its_connection_is_open(keeper: Keeper) -> None:
    """The writer exited (its socket still open in another process): the keeper finds it gone and grants the claim."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
        _writer_gone_connection_open(keeper.path, "w", held)
        with KeeperLink(keeper.path) as link:
            assert link.status()["engines"][0]["alive"]  # the keeper read no end of the writer's connection
            granted = link.claim("w")
            assert granted["bytes"] == 4096
            engines = link.status()["engines"]
            assert [e["alive"] for e in engines] == [False] and engines[0]["ended"] is not None


def test_a_new_process_of_an_engine_whose_writer_is_gone_may_say_hello(keeper: Keeper) -> None:
    """hello is not refused as busy for an engine whose process exited while its connection stays open."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held:
        _writer_gone_connection_open(keeper.path, "w", held)
        with KeeperLink(keeper.path) as link:
            assert link.hello("w")["keeper_pid"] == os.getpid()
            assert [b["engine"] for b in link.status()["backups"]] == ["w"]  # its backup is kept for adoption


def test_a_live_writer_still_holds_its_backup(keeper: Keeper) -> None:
    """While the writer's process lives, a claim is refused (pid N, which wrote it, is alive); once killed, granted."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as held, KeeperLink(keeper.path) as link:
        with _writer(keeper.path, "w", held) as writer:
            with pytest.raises(AdoptionRefused, match=f"pid {writer.pid}, which wrote it, is alive"):
                link.claim("w")
            assert link.status()["engines"][0]["alive"]
        assert link.claim("w")["pid"] == writer.pid


def test_a_process_is_gone_once_exited_a_zombie_or_its_pid_reused() -> None:
    """gone(): False for this process; True for an unreaped zombie, a reaped pid, or a pid that started at another time."""
    me = process_start(os.getpid())
    assert me is not None and not gone(os.getpid(), me)
    assert gone(os.getpid(), me + 1)  # the pid names another process than the one that connected
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = process_start(child.pid)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert gone(child.pid, started)
    child.wait()
    assert gone(child.pid, started)
