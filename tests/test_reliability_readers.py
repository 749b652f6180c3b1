"""Readers never break the writer and never lie: rotation, malformed payloads, stuck sidecars, hostile HTTP clients."""

from __future__ import annotations

import json
import logging
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import raw_event

from torpor.cli import main
from torpor.errors import LogCorrupted
from torpor.statemachine import SleepController, replay
from torpor.statemachine.core.events import EventKind
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.follow import Follower, follow
from torpor.statemachine.log.logsource import LogSource
from torpor.statemachine.log.reader import encode_line, read_events, segments
from torpor.statemachine.projection.view import Projection
from torpor.telemetry import serve
from torpor.testing import FakeMemory

# -- rotation ---------------------------------------------------------------------------


def _snapshot(log: EventLog, proj: Projection) -> Any:
    return raw_event(EventKind.SNAPSHOT, log.next_seq(), "e", 0, {"projection": proj.to_dict()})


def _append(log: EventLog, proj: Projection, n: int) -> None:
    for _ in range(n):
        event = raw_event(EventKind.USAGE_OBSERVED, log.next_seq(), "e", 0, {"usage": {"weights": 1 << 20}})
        log.append(event)
        proj.apply(event)


def test_reading_while_the_log_rotates_never_reports_corruption(tmp_path: Path) -> None:
    """read_events during rotations (and pruning) sees every event in order or a snapshot, never LogCorrupted."""
    path = tmp_path / "r.jsonl"
    log = EventLog(path, fsync=False, max_bytes=2000, keep=3)
    proj = Projection()
    _append(log, proj, 1)
    stop = threading.Event()
    rotations = [0]

    def write() -> None:
        while not stop.is_set():
            _append(log, proj, 1)
            if log.needs_rotation():
                snap = _snapshot(log, proj)
                log.rotate(snap)
                proj.apply(snap)
                rotations[0] += 1

    writer = threading.Thread(target=write)
    writer.start()
    failures: list[str] = []
    try:
        reads = 0
        while reads < 300 or rotations[0] < 20:
            try:
                events = list(read_events(path))
            except LogCorrupted as exc:
                failures.append(str(exc))
            else:
                seqs = [e.seq for e in events]
                assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            reads += 1
            if reads > 5000:
                break
    finally:
        stop.set()
        writer.join()
        log.close()
    assert failures == [], f"{len(failures)} false corruption reports, first: {failures[:1]}"


def test_a_deleted_middle_segment_reads_on_from_the_next_snapshot(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With a middle segment deleted, the log reads on from the snapshot that opens the next one (a warning says so)."""
    path = tmp_path / "r.jsonl"
    proj = Projection()
    with EventLog(path, fsync=False) as log:
        for _ in range(3):
            _append(log, proj, 3)
            snap = _snapshot(log, proj)
            log.rotate(snap)
            proj.apply(snap)
        _append(log, proj, 2)
    files = segments(path)
    assert len(files) == 4
    files[1].unlink()
    with caplog.at_level(logging.WARNING, "torpor.statemachine.log"):
        events = list(read_events(path))
    assert [e.seq for e in events] == [1, 2, 3, *range(8, 15)]
    assert "not on disk" in caplog.text
    assert replay(path).last_seq == 14


@pytest.mark.parametrize("new_file", ["empty", "snapshot"])
def test_a_rotation_between_listing_and_reading_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_file: str
) -> None:
    """The active file renamed just before the reader opens it (new file empty, or opened by its snapshot): no event is lost."""
    import torpor.statemachine.log.tail as tail_module

    path = tmp_path / "r.jsonl"
    proj = Projection()
    log = EventLog(path, fsync=False)
    _append(log, proj, 3)
    snap = _snapshot(log, proj)
    log.rotate(snap)
    proj.apply(snap)
    _append(log, proj, 3)  # segment r.jsonl.1 holds #1..#3; the active file #4 (snapshot) .. #7
    expected = list(range(1, 8))
    real = tail_module.open_regular
    rotated = []

    def rotating(file: Path) -> int:
        if file == path and not rotated:  # the writer rotates right before the reader opens the active file
            rotated.append(1)
            snap = _snapshot(log, proj)
            log.rotate(snap)
            proj.apply(snap)
            if new_file == "empty":
                path.write_bytes(b"")  # a crash right after the rename: the new file has no line yet
            else:
                expected.append(snap.seq)
        return real(file)

    monkeypatch.setattr(tail_module, "open_regular", rotating)
    assert [e.seq for e in read_events(path)] == expected
    log.close()


# -- malformed payloads -------------------------------------------------------------------

_BAD = {
    "missing tag": (EventKind.TAG_RELEASED, {"bytes": 5, "action": "offload"}, {}),
    "usage as a list": (EventKind.USAGE_OBSERVED, {"usage": [1, 2]}, {}),
    "bytes 1e999": (EventKind.TAG_RELEASED, {"tag": "weights", "bytes": "@BYTES@", "action": "offload"}, {}),
    "401-digit wall": (EventKind.CLOSED, {"state": "awake"}, {"wall": "@WALL@"}),
}


def _signed(raw: dict[str, Any]) -> bytes:
    body = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    body = body.replace('"@BYTES@"', "1e999").replace('"@WALL@"', "1" + "0" * 400)
    crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
    return f'{{"crc":"{crc:08x}",{body[1:]}\n'.encode()


def bad_log(path: Path, which: str) -> Path:
    """A log of two good events and a checksummed third line with the malformed payload ``which``."""
    with EventLog(path, fsync=False) as log:
        log.append(raw_event(EventKind.OPENED, 1, "demo", 0, {"usage": {"weights": 10}}))
        log.append(raw_event(EventKind.USAGE_OBSERVED, 2, "demo", 0, {"usage": {"weights": 10}}))
    kind, data, fields = _BAD[which]
    raw = raw_event(kind, 3, "demo", 0, {}).to_dict()
    raw.update(data=data, **fields)
    with open(path, "ab") as fh:
        fh.write(_signed(raw))
    return path


def _follow_all(path: Path) -> object:
    """Everything follow() yields until it is idle."""
    return list(follow(path, idle_timeout=0.01, poll=0.01))


READERS: dict[str, Callable[[Path], object]] = {
    "read_events": lambda p: list(read_events(p)),
    "replay": replay,
    "SleepController(log=...)": lambda p: SleepController(FakeMemory({"weights": 10}), log=p, engine="demo"),
    "Follower": lambda p: [f.read_available() for f in [Follower(p)] * 2],  # the good events, then the error
    "follow": _follow_all,
    "LogSource": LogSource,
}


@pytest.mark.parametrize("which", list(_BAD))
@pytest.mark.parametrize("reader", list(READERS))
def test_malformed_payloads_fail_every_reader_naming_file_and_line(tmp_path: Path, which: str, reader: str) -> None:
    """A checksummed line with a malformed payload makes every reader raise LogCorrupted at FILE:3."""
    path = bad_log(tmp_path / "demo.rank0.jsonl", which)
    with pytest.raises(LogCorrupted) as caught:
        READERS[reader](path)
    assert caught.value.path == str(path)
    assert caught.value.line == 3
    assert f"{path}:3:" in str(caught.value)


@pytest.mark.parametrize("which", list(_BAD))
@pytest.mark.parametrize(
    "argv",
    [["log", "show"], ["log", "follow", "--timeout", "0"], ["log", "replay"], ["plot"], ["demo", "--log-dir"]],
    ids=["log show", "log follow", "log replay", "plot", "demo"],
)
def test_cli_commands_fail_in_one_line_on_malformed_payloads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str, argv: list[str]
) -> None:
    """Every CLI command reading a log with a malformed payload exits 1 with one line naming FILE:3, no traceback."""
    path = bad_log(tmp_path / "demo.rank0.jsonl", which)
    target = str(tmp_path) if argv[0] == "demo" else str(path)
    extra = ["-o", str(tmp_path / "t.png")] if argv == ["plot"] else []
    code = main([*argv, target, *extra])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{path}:3:" in err


# -- a sidecar stuck at a bad line ---------------------------------------------------------


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET url: (status, headers, body), errors included."""
    request = urllib.request.Request(url, headers=headers or {})  # noqa: S310 - loopback
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def wait_until(condition: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Block until ``condition()`` holds (fails after ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_sidecar_stuck_at_a_bad_line_says_so(tmp_path: Path) -> None:
    """serve(path) whose log grows a bad line answers /state 503 naming FILE:LINE with the last good state; a repair heals it."""
    path = tmp_path / "demo.rank0.jsonl"
    controller = SleepController(FakeMemory({"weights": 10}), log=path, engine="demo")
    controller.sleep(1)
    controller.close()
    lines = path.read_bytes().count(b"\n")
    with serve(path) as server:
        status, _, body = fetch(server.url + "/state")
        assert status == 200 and json.loads(body)["state"] == "closed"  # the log ends with 'closed'
        assert json.loads(body)["machine_state"] == "asleep_l1"
        raw = raw_event(EventKind.TAG_RELEASED, controller.last_seq + 1, "demo", 0, {"bytes": 5}).to_dict()
        with open(path, "ab") as fh:
            fh.write(_signed(raw))
        wait_until(lambda: fetch(server.url + "/state")[0] == 503, "/state never said it was stuck")
        status, headers, body = fetch(server.url + "/state")
        answer = json.loads(body)
        assert answer["stuck"] is True and headers["X-Torpor-Stuck"] == "1"
        assert f"{path}:{lines + 1}:" in answer["error"]
        assert answer["state"]["machine_state"] == "asleep_l1"
        status, _, body = fetch(f"{server.url}/events?after={controller.last_seq}&wait=5")
        assert status == 503 and "stuck" in json.loads(body)["error"]
        good = raw_event(EventKind.USAGE_OBSERVED, controller.last_seq + 1, "demo", 0, {"usage": {"weights": 10}})
        text = path.read_bytes()
        path.write_bytes(text[: text.rstrip(b"\n").rfind(b"\n") + 1] + encode_line(good))  # repaired in place
        wait_until(lambda: fetch(server.url + "/state")[0] == 200, "a repaired line was never read")
        assert json.loads(fetch(server.url + "/state")[2])["last_seq"] == good.seq


# -- hostile HTTP clients ----------------------------------------------------------------------


def _raw_request(port: int, target: str, host: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection((host, port), timeout=10)
    sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


def test_hung_up_long_polls_free_their_slots_at_once(tmp_path: Path) -> None:
    """Long-polls whose clients hang up leave at once: their slots go back and a real poll is answered."""
    controller = SleepController(FakeMemory({"weights": 10}))
    with serve(controller, max_waiters=4, max_wait=30) as server:
        socks = [_raw_request(server.port, f"/events?after={controller.last_seq}&wait=30") for _ in range(4)]
        wait_until(lambda: server.waiting == 4, "the long-polls never started waiting")
        for sock in socks:
            sock.close()
        wait_until(lambda: server.waiting == 0, "hung-up long-polls still hold their slots", limit=3.0)
        status, _, _ = fetch(f"{server.url}/events?after={controller.last_seq}&wait=0.1")
        assert status == 200


def test_a_hang_up_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """A client that resets its connection mid-response costs no traceback on stderr."""
    controller = SleepController(FakeMemory({"weights": 10}))
    for _ in range(400):
        controller.observe()
    with serve(controller) as server:
        for _ in range(20):
            sock = _raw_request(server.port, "/events?after=0")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()  # RST while the server writes
        assert fetch(server.url + "/state")[0] == 200
    err = capfd.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err and "ConnectionReset" not in err


@pytest.mark.parametrize(
    "accept",
    [
        "application/openmetrics-text; version=abc",
        "application/openmetrics-text;version=1.0.0;q=0.6,text/plain;version=0.0.4;q=x",
        "text/plain;q=nan, application/openmetrics-text;version=",
        ";;,,;q=;",
    ],
)
def test_odd_accept_headers_are_answered(accept: str, capfd: pytest.CaptureFixture[str]) -> None:
    """A malformed Accept header on /metrics gets a 200 with metrics, not a dropped connection."""
    controller = SleepController(FakeMemory({"weights": 10}))
    with serve(controller) as server:
        status, _, body = fetch(server.url + "/metrics", {"Accept": accept})
    assert status == 200 and b"torpor_state" in body
    assert "Traceback" not in capfd.readouterr().err


def test_serve_binds_ipv6_loopback() -> None:
    """serve(host='::1') listens on the IPv6 loopback and answers there."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    controller = SleepController(FakeMemory({"weights": 10}))
    with serve(controller, host="::1") as server:
        assert server.url.startswith("http://[::1]:")
        status, _, body = fetch(server.url + "/state")
    assert status == 200 and json.loads(body)["state"] == "awake"


# -- files that are not logs, lines that never end, timeouts that never pass ----------------------


def _cli(*argv: str, limit: float = 20.0) -> subprocess.CompletedProcess[str]:
    """``python -m torpor ARGV`` in a child with 3 GiB of address space: (a hang fails the test, not the machine)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    try:
        return subprocess.run(
            [sys.executable, "-m", "torpor", *argv],
            capture_output=True,
            text=True,
            timeout=limit,
            preexec_fn=cap,  # only setrlimit, in the child
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"torpor {' '.join(argv)} still ran after {limit} s")


@pytest.mark.parametrize("action", ["show", "replay", "follow"])
@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_reader_refuses_a_file_that_is_not_a_regular_file(tmp_path: Path, action: str, special: str) -> None:
    """torpor log show/replay/follow on /dev/zero or a FIFO nobody writes exits 1 at once, saying it is not a regular file."""
    path = special
    if special == "fifo":
        path = str(tmp_path / "e.jsonl")
        os.mkfifo(path)
    extra = ["--timeout", "1"] if action == "follow" else []
    done = _cli("log", action, path, *extra)
    assert done.returncode == 1, done.stderr
    assert "not a regular file" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("reader", ["read_events", "Follower"])
def test_a_line_longer_than_the_limit_is_refused_holding_only_a_window(tmp_path: Path, reader: str) -> None:
    """A 64 MiB line without a newline: LogCorrupted naming the limit, with a few MiB of memory, not twice the file."""
    path = tmp_path / "e.jsonl"
    with EventLog(path, fsync=False) as log:
        log.append(raw_event(EventKind.USAGE_OBSERVED, 1, "e", 0, {"usage": {"weights": 1}}))
    with path.open("ab") as fh:
        fh.write(b"x" * (64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(LogCorrupted, match="longer than the 65536-byte limit") as caught:
            if reader == "read_events":
                list(read_events(path))
            else:
                with Follower(path) as follower:
                    follower.read_available()
                    follower.read_available()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.line == 2
    assert peak < 8 << 20, f"reading held {peak >> 20} MiB"


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_follow_refuses_a_timeout_that_never_passes(tmp_path: Path, value: str) -> None:
    """torpor log follow --timeout nan (or inf, or negative) is a usage error at once, not a follow that never ends."""
    path = tmp_path / "e.jsonl"
    SleepController(FakeMemory({"weights": 10}), log=path).close()
    done = _cli("log", "follow", str(path), "--timeout", value, limit=20)
    assert done.returncode == 2, done.stderr
    assert "--timeout" in done.stderr and "finite" in done.stderr
