"""Where the keeper listens: its socket's directory checked (or made, private), the path held under a lock, removed only while it is still this keeper's.

The directory: one that does not exist is made, mode 0700, and is the
keeper's own. One that exists is used as it is if it is a directory (not a
symlink) owned by this user that no group or other user may write (what the
engine checks before it connects); anything else is refused with the reason.
The keeper never changes the mode or the owner of a directory.

The path: a lock file beside the socket (``<socket>.lock``, mode 0600,
``flock``) is held for the keeper's whole life, so two keepers never both take
one path: the second finds the lock held and refuses, whether the first is
still between its bind and its listen or has served for days. Holding the
lock, a keeper replaces what is at the path only if it is a stream socket that
nobody answers (what a killed keeper leaves); a regular file, a directory, a
symlink, a FIFO, a live socket of another kind (a datagram service) or one that
answers is refused, named. The socket's device and inode are recorded at bind;
:meth:`Listening.close` removes the path only if it still names that socket,
then the lock file, before it lets the lock go.

Out of descriptors, ``accept`` fails (EMFILE) before it takes a connection, so
the keeper holds one descriptor back (:class:`Reserve`): it lets it go and
accepts on its number; if it can then take a reserve again, descriptors are to
be had and the connection is served like any other; if not, it gets one
refusal, and its own descriptor, shut down, becomes the reserve. A descriptor
closed and another opened in its place would leave its number free between the
two, for the next ``accept`` to take (then no reserve is left to refuse with).

A lock rather than binding to a temporary name and linking it in only if the
path is free: the link alone would leave a window at the end (between checking
that the path is still this keeper's and removing it) and say nothing of who
holds the path; the lock covers both and names the pid that holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import threading
from pathlib import Path

from torpor.errors import KeeperPathRefused

__all__ = ["Listening", "Reserve", "socket_directory"]

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a socket")


def socket_directory(path: Path) -> Path:
    """The directory of socket ``path``: made (mode 0700) if missing, else checked; never chmod'ed or chown'ed."""
    directory = path.parent
    try:
        directory.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        reason = f"cannot make its directory {directory} ({exc.strerror or exc})"
        raise KeeperPathRefused(str(path), reason) from exc
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise KeeperPathRefused(str(path), f"its directory {directory} is {_kind(info.st_mode)}, not a directory")
    if info.st_uid != os.getuid():
        reason = f"its directory {directory} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
        raise KeeperPathRefused(str(path), reason)
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("every user", stat.S_IWOTH)) if info.st_mode & bit]
    if writers:
        reason = (
            f"its directory {directory} (mode {stat.S_IMODE(info.st_mode):04o}) may be written by "
            f"{' and '.join(writers)}, who could replace the socket; name a socket in a directory only this user "
            "can write, or in one that does not exist yet (the keeper makes it, private)"
        )
        raise KeeperPathRefused(str(path), reason)
    return directory


class Listening:
    """The keeper's listening socket at ``path``, bound under the path's lock; :meth:`close` undoes only what it made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        socket_directory(path)
        self._lock = self._take_lock()
        self.socket: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        try:
            self._clear_path()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                old = os.umask(0o177)
                try:
                    listener.bind(str(path))
                finally:
                    os.umask(old)
                info = os.lstat(path)
                self._inode = (info.st_dev, info.st_ino)
                os.chmod(path, 0o600)
                listener.listen(64)
            except BaseException:
                listener.close()
                raise
            self.socket = listener
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> int:
        """Hold ``<socket>.lock`` (made if missing) for this keeper's life, or refuse naming the pid that holds it."""
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        while True:
            try:
                fd = os.open(self.lock_path, flags, 0o600)
            except OSError as exc:
                reason = f"its lock file {self.lock_path} cannot be opened ({exc.strerror or exc})"
                raise KeeperPathRefused(str(self.path), reason) from exc
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                    whose = f"{_kind(info.st_mode)} of uid {info.st_uid}"
                    raise KeeperPathRefused(str(self.path), f"its lock file {self.lock_path} is {whose}")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    reason = (
                        f"a keeper already serves there (pid {holder} holds {self.lock_path}); "
                        "stop it first or pick another --socket"
                    )
                    raise KeeperPathRefused(str(self.path), reason) from None
                try:
                    now = os.lstat(self.lock_path)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                    os.close(fd)  # its keeper removed it as it stopped: take the new one
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            return fd

    def _clear_path(self) -> None:
        """Remove a stream socket nobody answers at the path; refuse anything else (under the lock)."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            reason = (
                f"it is {_kind(info.st_mode)}, not a socket; the keeper replaces only a socket no keeper answers "
                "(pick another --socket)"
            )
            raise KeeperPathRefused(str(self.path), reason)
        if info.st_uid != os.getuid():
            raise KeeperPathRefused(str(self.path), f"the socket there belongs to uid {info.st_uid}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.path))
            except OSError as exc:
                if exc.errno == errno.EPROTOTYPE:
                    reason = "a live socket of another kind (a datagram service) listens there; it is not replaced"
                    raise KeeperPathRefused(str(self.path), reason) from exc
                if exc.errno != errno.ECONNREFUSED:
                    reason = f"the socket there cannot be probed ({exc.strerror or exc})"
                    raise KeeperPathRefused(str(self.path), reason) from exc
            else:
                reason = "a keeper already serves there (it answers); stop it first or pick another --socket"
                raise KeeperPathRefused(str(self.path), reason)
        self.path.unlink()  # nobody answers: what a killed keeper leaves

    def close(self) -> None:
        """Stop listening; remove the socket if the path still names it, then the lock file; let the lock go."""
        if self.socket is not None:
            with contextlib.suppress(OSError):
                self.socket.shutdown(socket.SHUT_RDWR)
            self.socket.close()
            self.socket = None
        if self._lock < 0:
            return
        if self._inode is not None and _inode(self.path) == self._inode:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self._inode = None
        if _inode(self.lock_path) == _inode_of(self._lock):
            with contextlib.suppress(FileNotFoundError):
                self.lock_path.unlink()
        os.close(self._lock)
        self._lock = -1


class Reserve:
    """One descriptor held back so that a keeper out of descriptors can still take a connection, to refuse it.

    :meth:`release` closes it so that the next descriptor made (an ``accept``'s)
    takes its number; :meth:`hold` takes one again; :meth:`lend` says the slot
    holds a connection being refused, and :meth:`park` makes that connection's
    descriptor, shut down, the reserve once the refusal is sent (no instant
    where its number is free). One refusal at a time: :meth:`release` waits for
    the one under way.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._fd = -1
        self._lent = False  # a connection refused on its slot has not been parked yet
        self._closed = False

    def hold(self) -> bool:
        """Hold a reserve (one opened where none is); False where no descriptor can be had, or once closed."""
        with self._cond:
            if self._fd < 0 and not self._closed:
                with contextlib.suppress(OSError):
                    self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            return self._fd >= 0

    def release(self, wait: float = 5.0) -> bool:
        """Close the reserve so that its number is free; False where none is held and none can be had.

        A refusal under way on its slot is waited for (``wait`` seconds at most: its
        peer has 2 s to send its request; False after that).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: not self._lent, timeout=wait):
                return False
            if not self.hold():
                return False
            os.close(self._fd)
            self._fd = -1
            return True

    def lend(self) -> None:
        """The connection accepted on the reserve's slot is to be refused: :meth:`release` waits for its :meth:`park`."""
        with self._cond:
            self._lent = True

    def park(self, conn: socket.socket) -> None:
        """Refused connection ``conn`` is done: shut down (its peer sees the end), its descriptor is the reserve."""
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        with self._cond:
            if self._fd < 0 and not self._closed:
                self._fd = conn.detach()
            else:
                conn.close()
            self._lent = False
            self._cond.notify_all()

    def close(self) -> None:
        """Close the reserve for good (the keeper stops)."""
        with self._cond:
            self._closed = True
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._lent = False
            self._cond.notify_all()


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _inode_of(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino
