"""Opening an event log's files safely on a shared host: the writer's side of :class:`~torpor.statemachine.log.reader.EventLog`.

A log directory such as ``/tmp/torpor-UID`` may sit in a directory every user
can write. So the writer:

- creates the directories it needs 0700 and never changes the mode of a
  directory or file it did not create;
- refuses a directory that belongs to someone else (other than root) or that
  others can write without the sticky bit, and a log path that is a link;
- opens the log with ``O_NOFOLLOW``, creates it with ``O_EXCL`` (0600), and
  refuses an existing file that is not a regular file, has other links, belongs
  to someone else or that others can write;
- holds an exclusive ``flock`` on ``.NAME.lock`` for the writer's lifetime, so
  a second writer on the same log is refused (:class:`~torpor.errors.LogLocked`).
  The lock dies with the writer: a child it forks (``multiprocessing``'s
  ``fork``, ``os.fork``) closes its inherited copy of the lock's descriptor at
  once (``os.register_at_fork``), so a helper that outlives a killed engine
  does not keep the restarted one out. (``exec`` closes it too: ``O_CLOEXEC``.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
import weakref
from pathlib import Path

from torpor.errors import LogLocked, UnsafeLogPath

logger = logging.getLogger("torpor.statemachine.log")

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC
_SHARED_OWNERS = (0,)  # root owns /tmp and /var/tmp: a sticky directory of root's is a shared one


def _euid() -> int:
    return os.geteuid()


def _describe(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"


def prepare_directory(directory: Path) -> None:
    """Create ``directory`` (and missing parents) 0700, or check that an existing one is safe to write a log into."""
    missing: list[Path] = []
    probe = directory
    while not os.path.lexists(probe):
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for new in reversed(missing):
        try:
            os.mkdir(new, 0o700)
        except FileExistsError:  # created meanwhile by someone else: checked below like any existing one
            continue
        os.chmod(new, 0o700, follow_symlinks=False)  # ours: the umask must not widen or narrow it
    check_directory(directory)


def check_directory(directory: Path) -> None:
    """Refuse a log directory that someone else could use to redirect or replace the log."""
    try:
        link = os.lstat(directory)
    except FileNotFoundError:
        raise UnsafeLogPath(str(directory), "the directory does not exist") from None
    me = _euid()
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (me, *_SHARED_OWNERS):
        raise UnsafeLogPath(
            str(directory), f"the directory is a symbolic link owned by someone else ({_describe(link)})"
        )
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeLogPath(str(directory), "it is not a directory")
    if st.st_uid not in (me, *_SHARED_OWNERS):
        raise UnsafeLogPath(
            str(directory),
            f"the directory belongs to someone else ({_describe(st)}); use a directory of your own "
            "(TORPOR_LOG_DIR, or log=)",
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        if not st.st_mode & stat.S_ISVTX:
            raise UnsafeLogPath(
                str(directory),
                f"others can write the directory and it is not sticky ({_describe(st)}), so they could replace the log",
            )
        logger.warning(
            "%s is a shared directory (mode %o): torpor leaves its mode as it is; its own files in it are 0600 "
            "(a private directory, such as the default <tempdir>/torpor-<uid>, is safer)",
            directory,
            stat.S_IMODE(st.st_mode),
        )


def check_file(path: Path, st: os.stat_result) -> None:
    """Refuse an existing log file torpor cannot trust to be its own."""
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeLogPath(str(path), "it is not a regular file")
    if st.st_uid != _euid():
        raise UnsafeLogPath(str(path), f"the file belongs to someone else ({_describe(st)})")
    if st.st_nlink != 1:
        raise UnsafeLogPath(str(path), f"the file has {st.st_nlink} hard links")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise UnsafeLogPath(str(path), f"others can write the file ({_describe(st)})")


def open_file(path: Path, *, readable: bool = False) -> tuple[int, bool]:
    """Open ``path`` for appending without following links; create it 0600 if absent. (fd, created)."""
    access = os.O_RDWR if readable else os.O_WRONLY
    for _ in range(8):  # created or removed by someone else between the two opens: look again
        try:
            fd = os.open(path, access | os.O_APPEND | os.O_CREAT | os.O_EXCL | _OPEN, 0o600)
        except FileExistsError:
            pass
        else:
            return fd, True
        try:
            fd = os.open(path, access | os.O_APPEND | os.O_NONBLOCK | _OPEN)  # NONBLOCK: a planted FIFO must not hang
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeLogPath(str(path), "it is a symbolic link") from None
            if exc.errno == errno.ENXIO:  # a FIFO nobody reads (O_NONBLOCK): not a file either
                raise UnsafeLogPath(str(path), "it is not a regular file") from None
            raise
        try:
            check_file(path, os.fstat(fd))
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd, False
    msg = f"{path} keeps appearing and disappearing"
    raise UnsafeLogPath(str(path), msg)


#: Every lock held in this process: a forked child closes their descriptors (:func:`_forget_in_child`).
_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    """In a forked child: close the inherited lock descriptors; the lock stays the parent's and dies with it."""
    for lock in list(_HELD):
        lock.forget()


os.register_at_fork(after_in_child=_forget_in_child)


class WriterLock:
    """An exclusive lock on ``.NAME.lock`` beside the log (hidden: globs of ``NAME.*`` see segments only), held until :meth:`release`."""

    def __init__(self, log_path: Path) -> None:
        self.path = log_path.with_name(f".{log_path.name}.lock")
        fd, _ = open_file(self.path, readable=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a writer that wrote no details"
            os.close(fd)
            raise LogLocked(str(log_path), holder) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        _HELD.add(self)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        except OSError:  # the details are informative only (a full disk must not stop the writer)
            pass

    def release(self) -> None:
        """Drop the lock (closing the file); safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def forget(self) -> None:
        """Close this process's descriptor without unlocking (a forked child's copy: the lock stays its parent's)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):  # an flock is dropped only when its last descriptor closes
                os.close(fd)
