"""Whether the process that wrote a log is still running, for the readers that report an interrupted log.

A log that ends inside a transition is either a command in flight (its writer
runs) or an interrupted one (its writer is gone: a crash, a kill). Readers on
the writer's host tell them apart by its pid (``os.kill(pid, 0)``); on another
host the answer is unknown, and a reused pid reads as running.
"""

from __future__ import annotations

import os

__all__ = ["writer_running"]


def writer_running(pid: int) -> bool | None:
    """True: a process ``pid`` runs on this host; False: none does; None: unknown (no pid recorded)."""
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    except OSError:
        return None
    return True
