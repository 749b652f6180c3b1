"""Subcommands of the ``torpor`` CLI, one module each (see ``torpor.cli``); :func:`seconds` parses their durations.

:func:`log_file` and :func:`no_events` give every command that reads one log the
same answers for what is no event log: not a regular file, or no event yet.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from torpor.errors import NoEvents, OutputRefused
from torpor.statemachine.core.timeouts import timeout_seconds
from torpor.statemachine.log.logsource import resolve_log

#: What every command says of a log that holds no complete event (``torpor status`` says it per rank).
NO_EVENT_YET = "holds no complete event yet (an engine writes its first when it opens the log)"

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"))


def seconds(text: str) -> float:
    """A number of seconds, finite and >= 0 (``nan`` passed every comparison, so a wait never ended)."""
    try:
        return timeout_seconds(float(text))
    except ValueError:  # not a number, or one no wait may take
        msg = f"{text!r} is not a finite number of seconds >= 0"
        raise argparse.ArgumentTypeError(msg) from None


def log_file(
    path: str | os.PathLike[str], engine: str | None = None, rank: int | None = None, *, hint: str | None = None
) -> Path:
    """The log ``path`` names (:func:`resolve_log`); a path that is no regular file is refused before anything is read."""
    log = resolve_log(path, engine, rank) if hint is None else resolve_log(path, engine, rank, hint=hint)
    try:
        mode = os.stat(log).st_mode
    except FileNotFoundError:  # a log whose base file rotated away: its segments are read
        return log
    if not stat.S_ISREG(mode):
        what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        msg = f"{log} is not a regular file ({what}): an event log is a regular file; nothing was read"
        raise OutputRefused(msg)
    return log


def no_events(path: Path) -> NoEvents:
    """The error every command raises for a log with no complete event (exit 1)."""
    return NoEvents(f"{path} {NO_EVENT_YET}")


def output_file(path: Path, *, name: str, suffix: str = "") -> Path:
    """Check ``-o PATH`` and make its directory (every command that writes a file does); one line naming it when it cannot be used.

    A directory is refused (``[Errno 21] Is a directory`` named no option; ``name`` is the file
    the line suggests in it), and with ``suffix`` a name without it (``plot -o noext`` said
    "wrote noext" and wrote ``noext.png``).
    """
    if path.is_dir():
        msg = f"cannot write -o {path}: it is a directory; give a file name, such as {path / name}"
        raise OutputRefused(msg)
    if suffix and path.suffix.lower() != suffix:
        msg = f"cannot write -o {path}: it is written as a {suffix} file; give a name ending in {suffix}, such as {path.with_suffix(suffix)}"
        raise OutputRefused(msg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        msg = f"cannot write -o {path}: {exc.strerror or exc} (give a path in a directory you can create and write)"
        raise OutputRefused(msg) from None
    return path


def write_output(path: Path, text: str, *, name: str) -> None:
    """Write ``text`` to ``-o PATH`` (:func:`output_file`); an error while writing is one line naming ``-o``."""
    try:
        output_file(path, name=name).write_text(text)
    except OSError as exc:
        msg = f"cannot write -o {path}: {exc.strerror or exc} (give a file you can write)"
        raise OutputRefused(msg) from None
