"""What ``torch_memory_saver.utils`` gives under the switch: ``is_xpu`` and ``change_env``, which TMS's test suite imports."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from torpor.tms.testingutils import is_xpu


@contextmanager
def change_env(key: str, value: str) -> Iterator[None]:
    """``os.environ[key] = value`` inside the block; the old value (or its absence) after."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


__all__ = ["change_env", "is_xpu"]
