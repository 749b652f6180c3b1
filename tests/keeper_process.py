"""Keeper processes for the tests, with no torch: a real keeper (:func:`start_keeper`, :func:`running_keeper`), and
another user's keeper (a squatter) where an engine looks for its own.

:func:`squatter` forks a process that drops to uid :data:`NOBODY` (root only: :data:`needs_root` skips
otherwise), makes a directory, listens in it and answers as a keeper would: ``create`` hands it a memfd,
``adopt`` and ``claim`` grant a backup of :data:`FILL` bytes for whatever identity is asked for. What it
heard (each op, and at ``publish`` how many bytes of its regions the engine wrote) is read back once it
is stopped (:attr:`Squatter.heard`).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from torpor.keeper import wire

ROOT = Path(__file__).resolve().parent.parent
#: The other user (``nobody``).
NOBODY = 65534
#: The byte a squatter's granted backup holds, everywhere.
FILL = 0x5A

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the other user is a child process that drops to uid 65534 (os.setuid)"
)


def as_nobody(act: Callable[[], str]) -> str:
    """What ``act()`` says in a forked child that drops to uid :data:`NOBODY` first (an exception: its type and text)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user from here on
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                said = act()
            except Exception as exc:
                said = f"{type(exc).__name__}: {exc}"
            os.write(write, said.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(pid, 0)
    return said


def start_keeper(sock: Path, budget: str = "1G") -> subprocess.Popen[str]:
    """``torpor keeper serve`` at ``sock`` in its own process, once it answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torpor", "keeper", "serve", "--socket", str(sock), "--budget", budget],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(sock))
        except OSError:
            if proc.poll() is not None:
                msg = f"the keeper exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
                raise RuntimeError(msg) from None
            time.sleep(0.05)
            continue
        finally:
            probe.close()
        return proc
    proc.kill()
    msg = f"the keeper at {sock} did not answer within 30 s"
    raise RuntimeError(msg)


@contextlib.contextmanager
def running_keeper(sock: Path, budget: str = "1G") -> Iterator[subprocess.Popen[str]]:
    """A keeper process at ``sock`` (:func:`start_keeper`) for the ``with`` block; killed after it."""
    proc = start_keeper(sock, budget)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@dataclass
class Squatter:
    """Another user's listening keeper socket: its directory, its path, its pid, and what it heard (once stopped)."""

    directory: Path
    path: Path
    pid: int
    heard: list[str] = field(default_factory=list)


@contextlib.contextmanager
def shared_tmp() -> Iterator[Path]:
    """A fresh directory that every user may create entries in (mode 1777, as /tmp), removed after."""
    base = Path(tempfile.mkdtemp(prefix="torpor-squat-", dir="/tmp"))
    try:
        os.chmod(base, 0o1777)  # noqa: S103  # another user must be able to make its directory here, as in /tmp
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def squatter(directory: Path) -> Iterator[Squatter]:
    """Uid :data:`NOBODY` makes ``directory`` (0700) and listens at ``directory/keeper.sock`` for the block."""
    ready_r, ready_w = os.pipe()
    heard_r, heard_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another user from here on; never returns into pytest
        try:
            os.close(ready_r)
            os.close(heard_r)
            _squat(directory, ready_w, heard_w)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(heard_w)
    squat = Squatter(directory, directory / "keeper.sock", pid)
    try:
        with os.fdopen(ready_r, "rb") as ready:
            said = ready.read().decode()
        if said != "listening":
            msg = f"the squatter (uid {NOBODY}) did not listen: {said or 'it exited'}"
            raise RuntimeError(msg)
        yield squat
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        with os.fdopen(heard_r, "rb") as heard:
            squat.heard = heard.read().decode().split()


def _squat(directory: Path, ready: int, heard: int) -> None:
    try:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        directory.mkdir(mode=0o700)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(directory / "keeper.sock"))
        listener.listen(8)
    except OSError as exc:
        os.write(ready, f"{type(exc).__name__}: {exc}".encode())
        return
    os.write(ready, b"listening")
    os.close(ready)
    regions: dict[int, int] = {}  # region -> memfd
    conns: list[socket.socket] = []
    while True:
        readable, _, _ = select.select([listener, *conns], [], [])
        for s in readable:
            if s is listener:
                conns.append(listener.accept()[0])
                continue
            try:
                request, fds = wire.receive(s)
            except (OSError, ValueError):
                conns.remove(s)
                s.close()
                continue
            for fd in fds:
                os.close(fd)
            op = str(request.get("op"))
            reply, out = _answer(op, request, regions)
            note = f"{op}:{_written(regions)}" if op == "publish" else op
            os.write(heard, f"{note}\n".encode())
            wire.send(s, reply, out)


def _answer(op: str, request: dict[str, Any], regions: dict[int, int]) -> tuple[dict[str, Any], list[int]]:
    """What a keeper would answer, from memory this user owns."""
    if op == "create":
        rid = len(regions) + 1
        regions[rid] = _memfd(int(request["nbytes"]), 0)
        return {"region": rid}, [regions[rid]]
    if op == "publish":
        return {"backup": "squatted"}, []
    if op in ("adopt", "claim"):
        tensors = request.get("identity", {}).get("tensors") or [{"name": "w", "nbytes": 64}]
        total, segments = 0, {}
        for t in tensors:
            segments[t["name"]] = {"segments": [[1, total, int(t["nbytes"])]]}
            total += int(t["nbytes"])
        regions.setdefault(1, _memfd(total, FILL))
        return {"backup": "squatted", "pid": 1, "bytes": total, "tensors": segments, "regions": {"1": total}}, []
    if op == "map":
        return {}, [regions[int(request["region"])]]
    return {"uid": os.getuid()}, []


def _memfd(nbytes: int, fill: int) -> int:
    fd = os.memfd_create("squatted", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    if fill:
        os.pwrite(fd, bytes([fill]) * nbytes, 0)
    return fd


def _written(regions: dict[int, int]) -> int:
    """Bytes of the squatter's regions that are not zero (what an engine wrote into this user's memory)."""
    total = 0
    for fd in regions.values():
        size = os.fstat(fd).st_size
        total += size - os.pread(fd, size, 0).count(0)
    return total
