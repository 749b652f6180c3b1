"""Once-per-process warnings for hooks: the same misconfiguration is reported once, not once per call site."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("torpor.hooks")

_lock = threading.Lock()
_seen: set[str] = set()


def warn_once(key: str, message: str) -> bool:
    """Log ``message`` as a warning unless ``key`` was warned about already; True when it was logged."""
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    logger.warning("%s", message)
    return True


def reset_warnings() -> None:
    """Forget which warnings were given (tests, or a process that reconfigures itself)."""
    with _lock:
        _seen.clear()
