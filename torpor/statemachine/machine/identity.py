"""Who a controller is and where its log goes: the engine and rank checks, the log's file, opened.

Checked before anything is made (:func:`check_identity`): with a log
directory the engine and rank name the file ``ENGINE.rankN.jsonl`` inside it
(:func:`log_path_for`), so both must name a file of their own there.
"""

from __future__ import annotations

from pathlib import Path

from torpor.errors import BadArgument, BadArgumentType
from torpor.statemachine.core.enginename import check_engine_name, refusal
from torpor.statemachine.log.eventlog import EventLog


def _clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


def names_a_directory(path: Path, given: str) -> bool:
    """Whether a ``log`` path names a directory: existing, ending in a separator, or new and without a suffix."""
    if path.is_dir() or given.endswith(("/", "\\")):
        return True
    return not path.exists() and not path.suffix


#: The largest rank a log can record (a JSON integer every reader takes: 2**63-1).
MAX_RANK = 2**63 - 1


def check_identity(engine: object, rank: object, *, names_file: bool) -> None:
    """Refuse an engine name outside the rule, a rank that is no integer 0..2**63-1 and, when the name names the
    log file, a name that is no plain file name.

    Every engine name keeps one rule (:mod:`torpor.statemachine.core.enginename`:
    printable, 1 to 200 bytes, no padding), log or no log: it reaches headers,
    labels, file names and terminals. With a log directory the engine and
    rank also name the file (``ENGINE.rankN.jsonl``) inside it, so
    ``"../escaped"`` would write outside it and ``"."`` name no file of its
    own; ``rank=-1`` or ``"0"`` were refused only when the first event was
    written, after the files were created. Checked before anything is made.
    """
    if type(engine) is not str:
        msg = f"engine must be a str naming the engine, got {type(engine).__name__} {engine!r}; nothing was created"
        raise BadArgumentType(msg)
    if type(rank) is not int:  # not True, not "0", not 0.0
        msg = f"rank must be an int, got {type(rank).__name__} {rank!r}; nothing was created"
        raise BadArgumentType(msg)
    if not 0 <= rank <= MAX_RANK:
        msg = f"rank {rank} is refused: a rank is 0..2**63-1 (rank 0 is the first); nothing was created"
        raise BadArgument(msg)
    problem = ""
    if names_file and (not engine or engine in (".", "..")):
        problem = "it names no file of its own"
    elif names_file and ("/" in engine or "\\" in engine):
        problem = "it holds a path separator, so its log would be written outside the log directory"
    elif names_file and engine.startswith("."):
        problem = "it starts with '.', which the log's hidden lock and rotation files use"
    if problem:
        rule = "it names the log file ENGINE.rankN.jsonl, so give a plain file name such as 'llm0'"
        msg = refusal(engine, problem, rule, refused="; nothing was created")
        raise BadArgument(msg)
    check_engine_name(engine, refused="; nothing was created")


def log_path_for(directory: str | Path, engine: str, rank: int) -> Path:
    """The file of ``engine``'s rank ``rank`` inside a shared log directory."""
    return Path(directory) / f"{engine}.rank{rank}.jsonl"


def open_log(log: EventLog | str | Path | None, engine: str, rank: int, *, fsync: bool) -> EventLog | None:
    """The controller's log: as given, or opened at a path (a directory's file is ``ENGINE.rankN.jsonl``); None: in memory only."""
    if not isinstance(log, str | Path):
        return log
    path = Path(log)
    if names_a_directory(path, str(log)):
        path = log_path_for(path, engine, rank)
    return EventLog(path, fsync=fsync)
