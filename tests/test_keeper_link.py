"""The engine's side of the keeper's socket: it talks only to a keeper of its own user, and says why it refuses another."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from keeper_process import NOBODY, as_nobody, needs_root, shared_tmp, squatter

from torpor.errors import KeeperPathRefused
from torpor.keeper import Keeper, KeeperLink, KeeperUnavailable, KeeperUntrusted
from torpor.keeper.listening import socket_directory
from torpor.keeper.wire import SOCKET_ENV


@pytest.fixture
def default_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The temp directory is a fresh 1777 one, and nothing names a socket: the keeper's path is the temp-directory one."""
    monkeypatch.delenv(SOCKET_ENV, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with shared_tmp() as base:
        monkeypatch.setenv("TMPDIR", str(base))
        monkeypatch.setattr(tempfile, "tempdir", str(base))
        yield base


@pytest.fixture
def own_keeper(tmp_path: Path) -> Iterator[Keeper]:
    """A keeper of this user in this process (a thread)."""
    k = Keeper(tmp_path / "k" / "keeper.sock", budget_bytes=1 << 20).start()
    yield k
    k.close()


@needs_root
def test_another_users_keeper_at_the_default_path_gets_nothing(default_tmp: Path) -> None:
    """Another user made torpor-keeper-<uid> in the temp directory first and listens: refused before a byte is sent."""
    directory = default_tmp / f"torpor-keeper-{os.getuid()}"
    with squatter(directory) as squat, pytest.raises(KeeperUntrusted) as refused:
        KeeperLink().hello("victim")
    assert squat.heard == []
    error = refused.value
    assert (error.path, error.found, error.expected) == (str(directory / "keeper.sock"), NOBODY, os.getuid())
    assert f"its directory {directory} belongs to another user" in str(error)
    assert f"uid {NOBODY}" in str(error) and f"expected: uid {os.getuid()}" in str(error)


@needs_root
def test_another_users_socket_in_our_directory_is_refused(tmp_path: Path) -> None:
    """The directory is ours (0700) but the socket in it is another user's: refused, naming the socket's owner."""
    with shared_tmp() as base, squatter(base / "k") as squat:
        os.chown(squat.directory, os.getuid(), os.getgid())
        with pytest.raises(KeeperUntrusted, match="the socket belongs to another user") as refused:
            KeeperLink(squat.path).hello("victim")
    assert squat.heard == []
    assert (refused.value.found, refused.value.expected) == (NOBODY, os.getuid())


@needs_root
def test_a_keeper_process_of_another_user_is_refused_by_its_credentials(tmp_path: Path) -> None:
    """Directory and socket are ours, but the process listening is another user's (SO_PEERCRED): refused, nothing sent."""
    with shared_tmp() as base, squatter(base / "k") as squat:
        os.chown(squat.directory, os.getuid(), os.getgid())
        os.chown(squat.path, os.getuid(), os.getgid())
        with pytest.raises(KeeperUntrusted, match=rf"the process listening there \(pid {squat.pid}\)") as refused:
            KeeperLink(squat.path).hello("victim")
    assert squat.heard == []
    assert (refused.value.found, refused.value.expected) == (NOBODY, os.getuid())


@needs_root
def test_an_engine_of_another_user_does_not_trust_roots_keeper() -> None:
    """A process of uid 65534 refuses a keeper run by root, even one whose directory and socket anyone may enter."""
    with shared_tmp() as base:
        root_keeper = Keeper(base / "k" / "keeper.sock", budget_bytes=1 << 20).start()
        try:
            os.chmod(root_keeper.path.parent, 0o755)  # noqa: S103  # open, so that only the engine's own check stands
            os.chmod(root_keeper.path, 0o666)  # noqa: S103
            said = _as_nobody(root_keeper.path)
        finally:
            root_keeper.close()
    assert said.startswith("KeeperUntrusted:"), said
    assert "belongs to another user (owner found: uid 0; expected: uid 65534" in said


def _as_nobody(path: Path) -> str:
    """What ``KeeperLink(path).status()`` gives a process of uid 65534 (a fork that drops to that uid)."""
    return as_nobody(lambda: f"served: {sorted(KeeperLink(path).status())}")


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777], ids=["0770", "0707", "1777"])
def test_a_socket_directory_others_may_write_is_refused(own_keeper: Keeper, mode: int) -> None:
    """Our own keeper, but its directory is writable by the group or by everyone (the socket could be swapped): refused."""
    os.chmod(own_keeper.path.parent, mode)
    with pytest.raises(KeeperUntrusted, match=f"mode {mode:04o}") as refused:
        KeeperLink(own_keeper.path)
    assert refused.value.found == refused.value.expected == os.getuid()
    os.chmod(own_keeper.path.parent, 0o700)
    with KeeperLink(own_keeper.path) as link:  # made private again, the same keeper is served
        assert link.status()["uid"] == os.getuid()


def test_a_symlinked_socket_directory_is_refused(own_keeper: Keeper, tmp_path: Path) -> None:
    """A socket reached through a symlinked directory is refused (the link could be pointed elsewhere)."""
    link = tmp_path / "elsewhere"
    link.symlink_to(own_keeper.path.parent)
    with pytest.raises(KeeperUntrusted, match=f"its directory {link} is a symlink"):
        KeeperLink(link / "keeper.sock")


def test_a_file_that_is_not_a_socket_is_no_keeper(tmp_path: Path) -> None:
    """A regular file of ours at the path is no keeper (unavailable, and left as it was); a missing directory neither."""
    directory = tmp_path / "k"
    directory.mkdir(mode=0o700)
    (directory / "keeper.sock").write_text("notes")
    with pytest.raises(KeeperUnavailable, match="not a socket"):
        KeeperLink(directory / "keeper.sock")
    assert (directory / "keeper.sock").read_text() == "notes"
    with pytest.raises(KeeperUnavailable, match="No such file"):
        KeeperLink(tmp_path / "nowhere" / "keeper.sock")


DIRECTORY_STATES = ["0700", "0770", "0707", "1777", "symlink", "another user's"]


@pytest.mark.parametrize("state", DIRECTORY_STATES)
def test_the_engine_refuses_the_directories_the_keeper_refuses(tmp_path: Path, state: str) -> None:
    """One rule on both sides: a socket directory the keeper will not listen in, the engine will not connect through."""
    if state == "another user's" and os.geteuid() != 0:
        pytest.skip("needs root to make a directory owned by another uid")
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    directory = real
    if state == "symlink":
        directory = tmp_path / "link"
        directory.symlink_to(real)
    elif state == "another user's":
        os.chown(real, NOBODY, NOBODY)
    else:
        os.chmod(real, int(state, 8))
    sock = directory / "keeper.sock"
    if state == "0700":
        assert socket_directory(sock) == directory
        with pytest.raises(KeeperUnavailable):  # a directory both accept: nothing listens in it yet
            KeeperLink(sock)
        return
    with pytest.raises(KeeperPathRefused):
        socket_directory(sock)
    with pytest.raises(KeeperUntrusted):
        KeeperLink(sock)
