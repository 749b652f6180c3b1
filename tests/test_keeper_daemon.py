"""The keeper process: its byte budget, owner-only access (socket permissions and SO_PEERCRED), its status."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from keeper_process import NOBODY, ROOT, as_nobody, start_keeper

from torpor.cli import main
from torpor.errors import KeeperPathRefused
from torpor.keeper import Keeper, KeeperBudgetExceeded, KeeperError, KeeperLink, ModelIdentity, TensorSpec, wire
from torpor.keeper.listening import socket_directory
from torpor.units import MiB


@pytest.fixture
def keeper(tmp_path: Path) -> Iterator[Keeper]:
    """A keeper in this process (a thread) with a budget of 8 MiB."""
    k = Keeper(tmp_path / "k" / "keeper.sock", budget_bytes=8 * MiB).start()
    yield k
    k.close()


def test_the_budget_refuses_cleanly(keeper: Keeper) -> None:
    """A region past the budget raises an error naming budget, used and asked; nothing changes and the link goes on."""
    with KeeperLink(keeper.path) as link:
        link.hello("e")
        rid, fd = link.create(4 * MiB)
        os.close(fd)
        with pytest.raises(KeeperBudgetExceeded) as info:
            link.create(6 * MiB)
        assert (info.value.budget, info.value.used, info.value.asked) == (8 * MiB, 4 * MiB, 6 * MiB)
        assert "budget is 8.00 MiB, 4.00 MiB are held and 6.00 MiB more were asked (2.00 MiB over)" in str(info.value)
        assert link.status()["used"] == 4 * MiB
        _, fd = link.create(4 * MiB)  # exactly up to the budget
        os.close(fd)
        link.free(rid)
        assert link.status()["used"] == 4 * MiB


def test_regions_of_an_engine_that_ends_without_a_backup_go(keeper: Keeper) -> None:
    """An engine's connection closing frees every region no published backup needs."""
    link = KeeperLink(keeper.path)
    link.hello("e")
    _, fd = link.create(2 * MiB)
    os.close(fd)
    link.close()
    with KeeperLink(keeper.path) as other:
        for _ in range(100):
            if other.status()["used"] == 0:
                break
            os.sched_yield()
        assert other.status()["used"] == 0


def test_status_prints_engines_tags_bytes_age_and_model(keeper: Keeper, capsys: pytest.CaptureFixture[str]) -> None:
    """torpor keeper status names each engine and each backup's tags, bytes, age and model identity."""
    identity = ModelIdentity.of("org/model@rev", [TensorSpec("w", (512, 1024), "bfloat16", MiB)])
    with KeeperLink(keeper.path) as link:
        link.hello("engine-a")
        rid, fd = link.create(2 * MiB)
        os.close(fd)
        manifest = {"identity": identity.to_dict(), "tags": ["weights"], "nbytes": MiB}
        link.publish({**manifest, "tensors": {"w": {"segments": [[rid, 0, MiB]]}}})
        assert main(["keeper", "status", "--socket", str(keeper.path)]) == 0
    out = capsys.readouterr().out
    assert "engine-a: pid" in out and "alive" in out
    assert "tags weights, 1.00 MiB, age 0 s, model org/model@rev: 1 tensors, 1048576 bytes" in out
    assert "holds 2.00 MiB of 8.00 MiB in 1 regions" in out


def test_a_publish_naming_bytes_outside_the_engines_regions_is_refused(keeper: Keeper) -> None:
    """A manifest may only point into regions this engine was given, within their size."""
    identity = ModelIdentity.of("m", [TensorSpec("w", (4,), "uint8", 4)])
    with KeeperLink(keeper.path) as link:
        link.hello("e")
        rid, fd = link.create(2 * MiB)
        os.close(fd)
        for segments in ([[rid, 2 * MiB - 2, 4]], [[rid + 99, 0, 4]]):
            with pytest.raises(Exception, match="outside this engine's regions"):
                link.publish({"identity": identity.to_dict(), "nbytes": 4, "tensors": {"w": {"segments": segments}}})


def _as_nobody(sock: Path) -> str:
    """What a process of uid 65534 gets from the keeper at ``sock`` (a fork that drops to that uid), on the raw wire."""

    def status() -> str:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(str(sock))
                # the keeper refuses another user at once, without reading: its refusal may close before the send
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    wire.send(conn, {"op": "status"})
                reply, _ = wire.receive(conn)
        except PermissionError as exc:
            return f"denied: the socket refused it ({exc.strerror})"
        return f"denied: {reply['message']}" if reply.get("error") == "denied" else f"served: {sorted(reply)}"

    return as_nobody(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client under another uid (os.setuid in a child)")
def test_another_users_process_is_refused() -> None:
    """A process of another uid gets nothing: refused by the private directory, and by SO_PEERCRED when it is opened."""
    base = Path(tempfile.mkdtemp(prefix="torpor-keeper-test-", dir="/tmp"))
    try:
        os.chmod(base, 0o755)  # noqa: S103  # the other user must reach the keeper's own directory to be refused there
        sock = base / "private" / "keeper.sock"
        proc = start_keeper(sock)
        try:
            assert (os.stat(sock.parent).st_mode & 0o777, os.stat(sock).st_mode & 0o777) == (0o700, 0o600)
            said = _as_nobody(sock)
            assert said.startswith("denied:") and "the socket refused it" in said, said
            os.chmod(sock.parent, 0o755)  # noqa: S103  # as if an operator opened the directory and the socket up
            os.chmod(sock, 0o666)  # noqa: S103  # so that only SO_PEERCRED stands in the way
            said = _as_nobody(sock)
            assert said == "denied: SO_PEERCRED says another user", said
            with KeeperLink(sock) as link:  # its own user is still served
                assert link.status()["uid"] == os.getuid()
        finally:
            proc.kill()
            proc.wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory owned by another uid")
def test_a_socket_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    """The keeper will not put its socket in a directory another user owns (it could be watched or replaced)."""
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(KeeperPathRefused, match="belongs to uid 65534"):
        socket_directory(d / "keeper.sock")


def test_drop_frees_a_dead_engines_backup_and_refuses_a_live_ones(
    keeper: Keeper, capsys: pytest.CaptureFixture[str]
) -> None:
    """torpor keeper drop refuses while the writer lives, then frees the backup and its regions once it is gone."""
    identity = ModelIdentity.of("m", [TensorSpec("w", (8,), "uint8", 8)])
    link = KeeperLink(keeper.path)
    link.hello("x")
    rid, fd = link.create(2 * MiB)
    os.close(fd)
    link.publish({"identity": identity.to_dict(), "nbytes": 8, "tensors": {"w": {"segments": [[rid, 0, 8]]}}})
    assert main(["keeper", "drop", "x", "--socket", str(keeper.path)]) == 1
    assert "was not dropped: pid" in capsys.readouterr().err
    link.close()
    with KeeperLink(keeper.path) as other:
        for _ in range(1000):
            if not other.status()["engines"][0]["alive"]:
                break
            os.sched_yield()
        assert other.status()["used"] == 2 * MiB  # the dead engine's backup keeps its region
        assert main(["keeper", "drop", "x", "--socket", str(keeper.path)]) == 0
        assert "dropped backup x-" in capsys.readouterr().out
        assert other.status()["used"] == 0


# -- where the keeper listens (issue 51 items 1-3, issue 54 item 3) ------------------------------------------


def _serve(sock: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``torpor keeper serve --socket sock`` in its own process, which must end (a refusal) within ``timeout``."""
    cmd = [sys.executable, "-m", "torpor", "keeper", "serve", "--socket", str(sock), "--budget", "64M"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


def _snapshot(d: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, int, int, bytes | None]]:
    """Mode, owner, group (and contents, for a regular file) of ``d`` and of each entry in it."""
    out = {}
    for p in [d, *sorted(d.iterdir())]:
        if p.name in skip:
            continue
        st = os.lstat(p)
        data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
        out["." if p == d else p.name] = (st.st_mode, st.st_uid, st.st_gid, data)
    return out


def _one_line_refusal(done: subprocess.CompletedProcess[str], *words: str) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    err = done.stderr.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    return err


def test_serve_refuses_a_regular_file_at_the_socket_path(tmp_path: Path) -> None:
    """keeper serve --socket FILE refuses in one line naming FILE and leaves its contents, mode and owner as they were."""
    d = tmp_path / "work"
    d.mkdir(mode=0o700)
    victim = d / "notasocket"
    victim.write_bytes(b"a user's data\n")
    before = _snapshot(d)
    _one_line_refusal(_serve(victim), str(victim), "not a socket")
    assert _snapshot(d) == before


def test_serve_never_changes_a_directory_it_did_not_create(tmp_path: Path) -> None:
    """A 0755 directory holding a file keeps its mode and contents; a 1777 one is refused with the reason, untouched."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)  # noqa: S103  # a directory of this user's that others may read
    (shared / "notes.txt").write_bytes(b"notes\n")
    before = _snapshot(shared)
    proc = start_keeper(shared / "keeper.sock")
    try:
        assert _snapshot(shared, skip=("keeper.sock", "keeper.sock.lock")) == before
        assert KeeperLink(shared / "keeper.sock").status()["keeper_pid"] == proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert _snapshot(shared) == before  # the socket (and its lock) went with the keeper; nothing else changed

    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # noqa: S103  # a copy of /tmp's mode
    (sticky / "theirs").write_bytes(b"someone else's\n")
    before = _snapshot(sticky)
    _one_line_refusal(_serve(sticky / "keeper.sock"), str(sticky), "1777", "written by")
    assert _snapshot(sticky) == before

    made = tmp_path / "new" / "private"
    proc = start_keeper(made / "keeper.sock")  # a directory it makes is its own: private
    try:
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_second_keeper_on_an_answered_socket_says_so_in_one_line(tmp_path: Path) -> None:
    """A second keeper serve where a keeper answers exits 1 with one line; the first keeps serving."""
    sock = tmp_path / "k" / "keeper.sock"
    proc = start_keeper(sock)
    try:
        _one_line_refusal(_serve(sock), "a keeper already serves", str(sock), str(proc.pid))
        assert KeeperLink(sock).status()["keeper_pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


_PAUSED_KEEPER = """
import pathlib, socket, sys, time
from torpor.cli import main
marks = pathlib.Path(sys.argv[2])
listen = socket.socket.listen
def paused(self, *args):
    (marks / "bound").touch()
    while not (marks / "go").exists():
        time.sleep(0.01)
    return listen(self, *args)
socket.socket.listen = paused
sys.exit(main(["keeper", "serve", "--socket", sys.argv[1], "--budget", "64M"]))
"""


def test_two_keepers_racing_for_one_path_never_both_serve(tmp_path: Path) -> None:
    """A keeper paused between bind and listen keeps its path: a second keeper started then refuses, and A serves."""
    sock, marks = tmp_path / "k" / "keeper.sock", tmp_path / "marks"
    marks.mkdir()
    first = subprocess.Popen([sys.executable, "-c", _PAUSED_KEEPER, str(sock), str(marks)], cwd=ROOT, text=True)
    try:
        for _ in range(3000):
            if (marks / "bound").exists() or first.poll() is not None:
                break
            time.sleep(0.01)
        assert (marks / "bound").exists(), "the first keeper never bound"
        second = subprocess.Popen(
            [sys.executable, "-m", "torpor", "keeper", "serve", "--socket", str(sock)],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            out, err = second.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
            pytest.fail("the second keeper took the path of a keeper between its bind and its listen")
        _one_line_refusal(subprocess.CompletedProcess(second.args, second.returncode, out, err), str(sock))
        (marks / "go").touch()
        for _ in range(3000):
            with contextlib.suppress(KeeperError):
                assert KeeperLink(sock).status()["keeper_pid"] == first.pid
                break
            time.sleep(0.01)
        assert KeeperLink(sock).status()["keeper_pid"] == first.pid
    finally:
        first.kill()
        first.wait()


def test_close_removes_only_its_own_socket(tmp_path: Path) -> None:
    """A keeper whose socket file was replaced leaves the new one in place when it stops."""
    k = Keeper(tmp_path / "k" / "keeper.sock", budget_bytes=8 * MiB).start()
    k.path.unlink()  # someone removed it, and something else listens there now
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(k.path))
        other.listen(1)
        inode = os.stat(k.path).st_ino
        k.close()
        assert os.stat(k.path).st_ino == inode


def test_a_stale_stream_socket_is_replaced_and_a_datagram_socket_is_not(tmp_path: Path) -> None:
    """A socket no keeper answers is taken over; a live datagram socket (a syslog-like service) is refused, untouched."""
    d = tmp_path / "k"
    d.mkdir(mode=0o700)
    stale = d / "keeper.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(stale))  # bound, never listening, closed: what a killed keeper leaves
    proc = start_keeper(stale)
    proc.kill()
    proc.wait()
    service = d / "log.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dgram:
        dgram.bind(str(service))
        inode = os.stat(service).st_ino
        _one_line_refusal(_serve(service), str(service), "datagram")
        assert os.stat(service).st_ino == inode
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(b"still here", str(service))
        assert dgram.recv(64) == b"still here"


# -- the protocol under misuse (issue 54 items 2, 4-9, 19) ----------------------------------------------------

_PUBLISH_AND_EXIT = """
import sys
from torpor.keeper import KeeperLink, ModelIdentity, TensorSpec
links = []
for engine in sys.argv[2:]:
    link = KeeperLink(sys.argv[1])
    link.hello(engine)
    rid, fd = link.create(1 << 20)
    identity = ModelIdentity.of("m", [TensorSpec("w", (4096,), "uint8", 4096)])
    link.publish({"identity": identity.to_dict(), "nbytes": 4096, "tensors": {"w": {"segments": [[rid, 0, 4096]]}}})
    links.append(link)
print("published", flush=True)
"""


def _dead_engines(sock: Path, *engines: str) -> None:
    """Each engine's backup (4096 bytes of tensor ``w``), published by a process that has exited since."""
    cmd = [sys.executable, "-c", _PUBLISH_AND_EXIT, str(sock), *engines]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert done.stdout.strip() == "published", done.stderr
    with KeeperLink(sock) as link:
        for _ in range(1000):
            if not any(e["alive"] for e in link.status()["engines"] if e["engine"] in engines):
                return
            time.sleep(0.01)
    pytest.fail(f"the keeper never saw {engines} end")


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _exchange(conn: socket.socket, data: bytes) -> dict[str, Any]:
    conn.sendall(data)
    reply, _ = wire.receive(conn)
    return reply


def _starve(pid: int) -> tuple[int, int]:
    """Lower process ``pid``'s descriptor limit to its lowest free descriptor number (its next open fails: EMFILE).

    Only the soft limit moves (raising a hard one takes a capability); the limits before are returned.
    """
    before = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    # the keeper closes an ended connection's descriptor on that connection's thread: wait until they settle
    taken = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    for _ in range(50):
        time.sleep(0.1)
        now = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        if now == taken:
            break
        taken = now
    lowest = min(set(range(len(taken) + 1)) - taken)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest, before[1]))
    return before


def test_running_out_of_descriptors_refuses_and_keeps_every_backup(tmp_path: Path) -> None:
    """Under a real RLIMIT_NOFILE, create is refused, a new connection refused, and the keeper lives on with its backups."""
    sock = tmp_path / "k" / "keeper.sock"
    proc = start_keeper(sock)
    try:
        _dead_engines(sock, "gone")
        link = KeeperLink(sock)
        link.hello("live")
        held = link.status()["used"]
        limits = _starve(proc.pid)
        with pytest.raises(KeeperError, match="descriptors") as info:
            link.create(MiB)
        assert "refused" in str(info.value), info.value
        assert link.status()["used"] == held  # the refusal left the connection usable, nothing made
        _starve(proc.pid)
        replies = []
        for _ in range(4):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(str(sock))
                replies.append(_exchange(conn, _frame(b'{"op":"status"}')))
        # the accept already waiting took its descriptor number before the limit fell (Linux reserves it first)
        for reply in replies[1:]:
            assert reply.get("error") == "resources" and "descriptors" in reply["message"], reply
        assert proc.poll() is None, "the keeper died"
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limits)
        assert link.status()["backups"][0]["engine"] == "gone"
        with KeeperLink(sock) as again:
            assert [b["engine"] for b in again.status()["backups"]] == ["gone"]
        _, fd = link.create(MiB)
        os.close(fd)
        link.close()
    finally:
        proc.kill()
        proc.wait()


def _nulls(pid: int) -> int:
    """How many of process ``pid``'s descriptors name /dev/null (the keeper's reserve is one)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}") == os.devnull
    return count


def test_a_connection_on_the_reserve_is_served_once_descriptors_are_back(tmp_path: Path) -> None:
    """Accepted on its reserve's slot after the limit rose again, a connection is served, not refused, and the reserve is back."""
    sock = tmp_path / "k" / "keeper.sock"
    proc = start_keeper(sock)
    try:
        reserve = _nulls(proc.pid)
        limits = _starve(proc.pid)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:  # the accept under way had its number
            conn.settimeout(30)
            conn.connect(str(sock))
            assert "error" not in _exchange(conn, _frame(b'{"op":"status"}'))
        deadline = time.monotonic() + 30
        while _nulls(proc.pid) >= reserve:  # the next accept failed: the keeper let its reserve go to accept on it
            assert time.monotonic() < deadline, "the keeper never let its reserve go"
            time.sleep(0.01)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limits)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(30)
            conn.connect(str(sock))
            reply = _exchange(conn, _frame(b'{"op":"status"}'))
            assert "error" not in reply, reply
            assert _nulls(proc.pid) == reserve  # it took its reserve back before it served
        assert proc.poll() is None, "the keeper died"
    finally:
        proc.kill()
        proc.wait()


def test_a_refused_connections_descriptor_becomes_the_reserve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of descriptors, each waiting connection is refused in turn: a refusal hands its slot back, opening none."""
    keeper = Keeper(tmp_path / "k" / "keeper.sock", budget_bytes=8 * MiB)
    keeper.bind()  # no serve loop: this test plays it, as if every accept failed with EMFILE
    real_open = os.open

    def no_descriptor_for_a_reserve(path: Any, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        if path == os.devnull:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", no_descriptor_for_a_reserve)
    short = OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    try:
        for _ in range(3):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(10)
                conn.connect(str(keeper.path))
                conn.sendall(_frame(b'{"op":"status"}'))
                keeper._shed(keeper._listener, short)  # type: ignore[arg-type]
                reply, _ = wire.receive(conn)
                assert reply.get("error") == "resources" and "out of file descriptors" in reply["message"], reply
                assert conn.recv(1) == b""  # one refusal, then the end
    finally:
        keeper.close()


def test_a_second_connection_of_a_live_engine_closing_leaves_it_alive(keeper: Keeper) -> None:
    """An engine's process that says hello on a second connection and closes it is still alive on its first."""
    first = KeeperLink(keeper.path)
    first.hello("e")
    second = KeeperLink(keeper.path)
    second.hello("e")
    second.close()
    with KeeperLink(keeper.path) as watcher:
        for _ in range(200):
            time.sleep(0.005)
            engines = watcher.status()["engines"]
            assert engines and engines[0]["alive"], engines
    first.close()


def test_a_connection_that_claimed_two_engines_releases_both_when_it_ends(keeper: Keeper) -> None:
    """A claim of engine A then B on one connection: both go when the connection ends; neither sticks to a dead pid."""
    _dead_engines(keeper.path, "a", "b")
    claimer = KeeperLink(keeper.path)
    claimer.claim("a")
    claimer.claim("b")
    claimer.close()
    with KeeperLink(keeper.path) as link:
        for _ in range(1000):
            adopters = {b["engine"]: b["adopter"] for b in link.status()["backups"]}
            if adopters == {"a": None, "b": None}:
                return
            time.sleep(0.01)
    pytest.fail(f"claims stuck after the connection ended: {adopters}")


def test_malformed_frames_are_refused_with_a_reply_and_no_traceback(tmp_path: Path) -> None:
    """Not JSON, a JSON array, a 4 GiB length, 1e400, a 5000-digit int, dense nesting: a refusal each, nothing logged."""
    sock = tmp_path / "k" / "keeper.sock"
    proc = start_keeper(sock)
    try:
        hello = _frame(b'{"op":"hello","engine":"e"}')
        cases = [
            _frame(b"not json"),
            _frame(b"[1, 2]"),
            _frame(b'{"op":"create","nbytes":1e400}'),
            _frame(b'{"op":"create","nbytes":' + b"9" * 5000 + b"}"),
            _frame(b'{"op":"status","x":' + b"[]," * 100000 + b"[]}"),
            _frame(b'{"op":"create","nbytes":true}'),
            b"\xff\xff\xff\xff",
        ]
        for data in cases:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(str(sock))
                assert "error" not in _exchange(conn, hello)
                reply = _exchange(conn, data)
                assert reply.get("error") == "usage" and reply["message"], (data[:40], reply)
        with KeeperLink(sock) as link:
            assert link.status()["keeper_pid"] == proc.pid
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "Traceback" not in out, out


def test_a_frame_over_the_limit_is_refused_before_it_is_read(keeper: Keeper) -> None:
    """A header announcing 60 MiB gets its refusal at once, before any of the body is sent."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(keeper.path))
        reply = _exchange(conn, struct.pack(">I", 60 * MiB))
        assert reply["error"] == "usage" and "limit" in reply["message"], reply


def test_an_engine_name_over_the_limit_is_refused_at_hello(keeper: Keeper) -> None:
    """A 234-byte engine name is refused at hello naming the limit; a 200-byte one gets regions as any other."""
    with KeeperLink(keeper.path) as link:
        with pytest.raises(KeeperError, match="over the 200 bytes"):
            link.hello("e" * 234)
        link.hello("é" * 100)
        _, fd = link.create(MiB)
        os.close(fd)


def test_a_manifest_that_does_not_cover_each_tensor_exactly_is_refused(keeper: Keeper) -> None:
    """Segments covering 16 of a tensor's 4096 bytes, a tensor the identity lacks, or a wrong total: refused at publish."""
    identity = ModelIdentity.of("m", [TensorSpec("w", (4096,), "uint8", 4096)]).to_dict()
    with KeeperLink(keeper.path) as link:
        link.hello("e")
        rid, fd = link.create(MiB)
        os.close(fd)
        bad = [
            ({"w": {"segments": [[rid, 0, 16]]}}, 4096, "cover 16 of its 4096 bytes"),
            ({"w": {"segments": [[rid, 0, 4096]]}, "x": {"segments": [[rid, 0, 8]]}}, 4096, "not in the identity"),
            ({}, 4096, "not in the manifest"),
            ({"w": {"segments": [[rid, 0, 4096]]}}, 99, "nbytes"),
        ]
        for tensors, nbytes, words in bad:
            with pytest.raises(KeeperError, match=words):
                link.publish({"identity": identity, "nbytes": nbytes, "tensors": tensors})
        assert link.status()["backups"] == []
        link.publish({"identity": identity, "nbytes": 4096, "tensors": {"w": {"segments": [[rid, 0, 4096]]}}})


def test_status_computes_no_digest_under_the_keepers_lock(keeper: Keeper, monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity's digest is computed once, at publish, outside the lock; status reads it."""
    under_lock: list[bool] = []
    digest = ModelIdentity.digest

    def watched(self: ModelIdentity) -> str:
        under_lock.append(keeper._lock.locked())
        return digest(self)

    monkeypatch.setattr(ModelIdentity, "digest", watched)
    identity = ModelIdentity.of("m", [TensorSpec(f"w{i}", (8,), "uint8", 8) for i in range(1000)])
    with KeeperLink(keeper.path) as link:
        link.hello("e")
        rid, fd = link.create(MiB)
        os.close(fd)
        tensors = {f"w{i}": {"segments": [[rid, 8 * i, 8]]} for i in range(1000)}
        manifest = {"identity": identity.to_dict(), "nbytes": 8000, "tensors": tensors}
        under_lock.clear()
        link.publish(manifest)
        published = len(under_lock)
        for _ in range(3):
            assert link.status()["backups"][0]["digest"] == digest(identity)
    assert published and not any(under_lock), under_lock
    assert len(under_lock) == published  # status computed none
