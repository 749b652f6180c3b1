"""The event log on a shared host: planted links and files, foreign directories, two writers, a full disk, long histories."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from support import raw_event

from torpor.errors import EventTooLarge, LogLocked, LogWriteFailed, NotAnEventLog, UnsafeLogPath
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.core.states import State
from torpor.statemachine.log import reader as log_module
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.reader import read_events, replay, segments
from torpor.statemachine.machine.controller import SleepController
from torpor.statemachine.projection.view import MAX_GRAPH_SITES
from torpor.testing import FakeMemory

TAGS = {"weights": 4096, "kv_cache": 8192, "runtime": 1024, "cudagraph": 2048}
OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a file someone else's needs root")


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _snapshot(path: Path) -> tuple[bytes, int, int]:
    st = os.lstat(path)
    return path.read_bytes(), stat.S_IMODE(st.st_mode), st.st_uid


def test_planted_symlink_is_not_followed(tmp_path: Path) -> None:
    """A symlink planted at the log path is refused; the file it points to is not truncated, written or chmodded."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\npartial")
    victim.chmod(0o644)
    before = _snapshot(victim)
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    (logs / "e.rank0.jsonl").symlink_to(victim)
    with pytest.raises(UnsafeLogPath, match="symbolic link"):
        SleepController(FakeMemory(TAGS), log=logs, engine="e", rank=0)
    assert _snapshot(victim) == before


@needs_root
def test_file_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    """A log file that belongs to another user (planted in a shared directory) is refused and left as it was."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    planted = shared / "e.rank0.jsonl"
    planted.write_bytes(b"attacker's\n")
    os.chown(planted, OTHER_UID, OTHER_UID)
    before = _snapshot(planted)
    with pytest.raises(UnsafeLogPath, match="belongs to someone else"):
        SleepController(FakeMemory(TAGS), log=planted)
    assert _snapshot(planted) == before


@needs_root
def test_directory_owned_by_someone_else_is_refused_and_left_alone(tmp_path: Path) -> None:
    """A log directory made by another user (say /tmp/torpor) is refused, its mode untouched, nothing written into it."""
    theirs = tmp_path / "torpor"
    theirs.mkdir()
    theirs.chmod(0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeLogPath, match="belongs to someone else"):
        SleepController(FakeMemory(TAGS), log=theirs, engine="e", rank=0)
    assert _mode(theirs) == 0o755
    assert list(theirs.iterdir()) == []


def test_directory_others_can_write_is_refused_and_not_chmodded(tmp_path: Path) -> None:
    """A directory writable by others without the sticky bit is refused; torpor does not change its mode."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(UnsafeLogPath, match="not sticky"):
        EventLog(open_dir / "e.jsonl")
    assert _mode(open_dir) == 0o777


def test_existing_directories_keep_their_mode(tmp_path: Path) -> None:
    """torpor never changes the mode of a directory it did not create: a sticky shared one, or the user's own 0755."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    own = tmp_path / "own"
    own.mkdir()
    own.chmod(0o755)
    for directory, mode in ((sticky, 0o1777), (own, 0o755)):
        ctrl = SleepController(FakeMemory(TAGS), log=directory, engine="e", rank=0)
        ctrl.close()
        assert _mode(directory) == mode  # sticky bit included
        assert _mode(directory / "e.rank0.jsonl") == 0o600
    made = tmp_path / "new" / "deeper"
    SleepController(FakeMemory(TAGS), log=made, engine="e", rank=0).close()
    assert _mode(made) == 0o700 and _mode(made.parent) == 0o700  # what torpor creates is private


def test_json_file_passed_as_log_is_refused_untouched(tmp_path: Path) -> None:
    """A file that is not a torpor log (a JSON document without a final newline) is neither truncated nor appended to."""
    config = tmp_path / "config.json"
    config.write_bytes(b'{"model": "llama"}\n{"last": "line without newline"}')
    config.chmod(0o600)
    before = _snapshot(config)
    with pytest.raises(NotAnEventLog, match="not a torpor event log"):
        SleepController(FakeMemory(TAGS), log=config)
    assert _snapshot(config) == before


def test_device_or_fifo_passed_as_log_is_refused_untouched(tmp_path: Path) -> None:
    """A device node (a null device, as root) or a FIFO is not a regular file: refused, its mode and its directory's kept."""
    tmp_path.chmod(0o755)
    if os.geteuid() == 0:
        node = tmp_path / "null"
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    else:
        node = tmp_path / "fifo"
        os.mkfifo(node, 0o666)
    node.chmod(0o666)
    with pytest.raises(UnsafeLogPath, match="not a regular file"):
        SleepController(FakeMemory(TAGS), log=node)
    assert _mode(node) == 0o666
    assert _mode(tmp_path) == 0o755


def test_second_writer_is_refused_for_the_first_ones_lifetime(tmp_path: Path) -> None:
    """A second writer on one log is refused with LogLocked naming the holder; once the first closes, it may write."""
    path = tmp_path / "e.jsonl"
    first = SleepController(FakeMemory(TAGS), log=path)
    with pytest.raises(LogLocked, match=f"pid {os.getpid()}"):
        SleepController(FakeMemory(TAGS), log=path)
    with pytest.raises(LogLocked):
        EventLog(path)
    first.sleep(1)
    first.close()
    second = SleepController(FakeMemory(TAGS), log=path)
    assert second.last_seq > first.last_seq
    second.close()
    seqs = [e.seq for e in read_events(path)]
    assert seqs == list(range(1, len(seqs) + 1))


class DiskFull:
    """``os.write`` on the log's files that writes ``room`` more bytes, then fails with ENOSPC until freed."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.full = True
        self.real = os.write

    def __call__(self, fd: int, data: Any) -> int:
        if not self.full or not _is_log(fd):
            return self.real(fd, data)
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = self.real(fd, bytes(data[: self.room]))  # a short write
        self.room -= n
        return n


def _is_log(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").endswith((".jsonl", ".next"))
    except OSError:
        return False


FULL_DISK = """
import json, os, resource, signal, sys
from torpor.statemachine.machine.controller import SleepController
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.core.states import State
from torpor.testing import FakeMemory

path, room = sys.argv[1], int(sys.argv[2])
memory = FakeMemory({"weights": 4096, "kv_cache": 8192, "runtime": 1024, "cudagraph": 2048})
ctrl = SleepController(memory, EventLog(path, fsync=False))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write is cut short, then fails (EFBIG)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + room, hard))
try:
    ctrl.sleep(1)
    outcome = "slept"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
report = {"outcome": outcome, "state": ctrl.state.value, "intact": all(memory.content(t) is not None for t in memory.usage())}
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space is back
try:
    if ctrl.state is State.SUSPENDING:
        ctrl.recover()
    ctrl.sleep(1)
    ctrl.wake()
    report["after"] = ctrl.state.value
except Exception as exc:
    report["after"] = f"{type(exc).__name__}: {exc}"
report["projection"] = ctrl.projection.to_dict()
print(json.dumps(report))
"""


@pytest.mark.parametrize("room", [300, 700, 1100])
def test_full_disk_leaves_a_readable_log_and_a_rolled_back_sleep(tmp_path: Path, room: int) -> None:
    """The file size limit hit mid-sleep (a short write, then EFBIG): no torn line, sleep rolled back or resumable, then works."""
    import json
    import subprocess
    import sys

    path = tmp_path / "e.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(path), str(room)],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["state"] in ("awake", "suspending"), report  # rolled back, or waiting for recover()
    assert report["intact"], "the memory was left released"
    assert report["after"] == "awake", report["after"]
    data = path.read_bytes()
    assert data.endswith(b"\n")
    assert replay(path).to_dict() == report["projection"]  # readable, and what the live controller said
    assert report["outcome"].startswith("LogWriteFailed"), report["outcome"]


def test_short_write_is_completed_and_enospc_cut_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EventLog.append continues a short write, and cuts a failed one back to the last whole line."""
    path = tmp_path / "e.jsonl"
    log = EventLog(path, fsync=False)
    calls = []
    real = os.write

    def short(fd: int, data: Any) -> int:
        calls.append(len(data))
        return real(fd, bytes(data[: max(1, len(data) // 2)]))

    monkeypatch.setattr(log_module.os, "write", short)
    log.append(raw_event(EventKind.OPENED, 1, "e", 0, {"usage": {}}))
    assert len(calls) > 1  # continued, not abandoned
    disk = DiskFull(room=10)
    monkeypatch.setattr(log_module.os, "write", disk)
    with pytest.raises(LogWriteFailed):
        log.append(raw_event(EventKind.USAGE_OBSERVED, 2, "e", 0, {"usage": {"weights": 1}}))
    assert [e.seq for e in read_events(path)] == [1]
    assert path.read_bytes().endswith(b"\n")
    disk.full = False
    log.append(raw_event(EventKind.USAGE_OBSERVED, 2, "e", 0, {"usage": {"weights": 1}}))
    log.close()
    assert [e.seq for e in read_events(path)] == [1, 2]


def test_full_disk_during_rotation_keeps_the_log_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotation that cannot write its snapshot leaves the active file as it was; the next rotation works."""
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=False, max_bytes=4096))
    real = os.write

    def no_room_for_next(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".next"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(log_module.os, "write", no_room_for_next)
    for _ in range(4):
        ctrl.sleep(1)
        ctrl.wake()
    assert segments(path) == [path]  # no rotation happened, nothing lost
    monkeypatch.setattr(log_module.os, "write", real)
    for _ in range(12):
        ctrl.sleep(1)
        ctrl.wake()
    assert len(segments(path)) > 1
    assert replay(path).to_dict() == ctrl.projection.to_dict()


def test_snapshots_stay_bounded_over_thousands_of_captures(tmp_path: Path) -> None:
    """10,000 graph captures (vLLM's piecewise capture makes thousands): snapshots stay small, nothing raises EventTooLarge."""
    path = tmp_path / "e.jsonl"
    ctrl = SleepController(FakeMemory(TAGS), EventLog(path, fsync=False, max_bytes=256 * 1024))
    site = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._capture_cudagraphs piecewise batch={} #{}"
    try:
        for n in range(10_000):
            with ctrl.capture(site.format(n % 512, n)):
                pass
    except EventTooLarge as exc:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"a snapshot outgrew the line limit: {exc}")
    ctrl.sleep(1)
    ctrl.wake()
    snapshots = [e for e in read_events(path) if e.kind is EventKind.SNAPSHOT]
    assert snapshots, "the log never rotated"
    largest = max(len(log_module.encode_line(e)) for e in snapshots)
    assert largest < 16 * 1024, f"a snapshot of {largest} bytes"
    proj = replay(path)
    assert proj.graph_count == 10_000
    assert len(proj.graphs) == MAX_GRAPH_SITES and proj.graphs[-1] == site.format(9_999 % 512, 9_999)
    assert proj.to_dict() == ctrl.projection.to_dict()


HOLDER = """
import sys
from torpor.statemachine.machine.controller import SleepController
from torpor.testing import FakeMemory

ctrl = SleepController(FakeMemory({"weights": 4096}), log=sys.argv[1], fsync=False)
print("ready", flush=True)
sys.stdin.readline()
ctrl.sleep(1)
ctrl.close()
"""


def test_writer_in_another_process_is_detected(tmp_path: Path) -> None:
    """Another engine process writing the same log: this one is refused with its pid named; none of its lines interleave."""
    import subprocess
    import sys

    path = tmp_path / "vllm.rank0.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(LogLocked, match=f"pid {holder.pid}"):
            SleepController(FakeMemory(TAGS), log=path)
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.wait(60) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
    ctrl = SleepController(FakeMemory(TAGS), log=path)  # the lock went with the process
    ctrl.close()
    events = list(read_events(path))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    assert [e.pid for e in events if e.kind is EventKind.SLEEP_COMPLETED] == [holder.pid]
    assert replay(path).state is State.AWAKE  # reopened by a new process: fresh memory
