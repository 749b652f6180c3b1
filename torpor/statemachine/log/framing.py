"""Framing a log file's bytes into lines, a bounded window at a time, and refusing what is not a log file.

Every reader of a log (:mod:`torpor.statemachine.log.tail`) reads through here, so
that none can be made to hold more than about two windows of memory or to
wait forever: a file that is not a regular file (``/dev/zero``, a FIFO, a
device) is refused when it is opened, and a line longer than the line limit
(``max_line``, :data:`~torpor.statemachine.log.codec.DEFAULT_MAX_LINE` = 64 KiB by
default, the writer's limit too) is ``LogCorrupted`` once a window without a
newline has been read, whatever the file holds after it.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from torpor.errors import LogCorrupted

logger = logging.getLogger("torpor.statemachine.log")

#: Bytes read at a time (at least one line longer than the limit).
CHUNK = 1 << 20


def open_regular(file: Path) -> int:
    """A read-only descriptor of the regular file ``file`` (``FileNotFoundError`` when it is not there).

    Opened without blocking (a FIFO nobody writes would hang ``open``), and
    refused unless it is a regular file: ``/dev/zero`` or a FIFO never ends,
    so a reader would wait, or read, forever.
    """
    fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = _KINDS.get(stat.S_IFMT(mode), "not a file")
        raise LogCorrupted(
            str(file), 1, f"not a regular file ({what}): an event log is a regular file; nothing was read"
        )
    return fd


_KINDS = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def window(max_line: int) -> int:
    """Bytes read at a time: a whole line of the longest kind always fits, so a window without a newline is too long."""
    return max(CHUNK, max_line + 1)


def read_lines(fd: int, pos: int, max_line: int) -> tuple[list[bytes], int, int]:
    """One window of ``fd`` from ``pos``: (whole lines without newlines, bytes they take, bytes after them).

    The last is -1 when the window was full (the file may go on: read again
    from after the lines), else the length of the torn end of the file.
    """
    size = window(max_line)
    data = os.pread(fd, size, pos)
    lines = data.split(b"\n")
    rest = len(lines.pop())
    return lines, len(data) - rest, rest if len(data) < size else -1


def too_long(name: str, lineno: int, max_line: int) -> LogCorrupted:
    """The error of a line with no newline within ``max_line + 1`` bytes."""
    return LogCorrupted(
        name, lineno, f"line is longer than the {max_line}-byte limit (no newline within {max_line + 1} bytes)"
    )


def batches(file: Path, max_line: int, torn: list[int]) -> Iterator[list[bytes]]:
    """The whole lines of ``file`` in batches of about a window; ``torn[0]``: bytes after the last newline.

    Memory stays about two windows whatever the file: a line longer than
    ``max_line`` raises ``LogCorrupted`` (the lines before it come first).
    """
    fd = open_regular(file)
    try:
        pos, lineno = 0, 0
        while True:
            lines, used, rest = read_lines(fd, pos, max_line)
            if lines:
                yield lines
            pos += used
            lineno += len(lines)
            if rest >= 0:
                if rest > max_line:
                    raise too_long(str(file), lineno + 1, max_line)
                torn[0] = rest
                return
            if not lines:
                raise too_long(str(file), lineno + 1, max_line)
    finally:
        os.close(fd)


def warn_torn(file: str | os.PathLike[str], lineno: int, nbytes: int) -> None:
    """Say that an unfinished last line is left out."""
    logger.warning("%s:%d: ignoring a torn last line (%d bytes): the writer was interrupted", file, lineno, nbytes)


__all__ = ["CHUNK", "batches", "open_regular", "read_lines", "too_long", "warn_torn", "window"]
