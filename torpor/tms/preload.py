"""``configure_subprocess()``: put torpor's preload library on ``LD_PRELOAD`` for child processes, as TMS does.

TMS prepends its ``torch_memory_saver_hook_mode_preload*.so`` (``LIB:REST``, or
``LIB`` alone) for the duration of the block and restores the old value after.
torpor does the same with its own library, whose name also contains
``torch_memory_saver`` (code that looks for that string on ``LD_PRELOAD``
finds it). Until that library is built (docs/tms.md, "Preload mode"), the
block changes nothing and says so once: torpor's preload mode then tags what
torch allocates inside ``region()`` through torpor's pools, as its torch mode does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger("torpor.tms")

PRELOAD_NAME = "libtorpor_torch_memory_saver_preload.so"
LD_PRELOAD = "LD_PRELOAD"


def preload_library() -> Path | None:
    """The path of torpor's preload library, None when it is not built."""
    path = Path(__file__).resolve().parent / PRELOAD_NAME
    return path if path.is_file() else None


def prepended(current: str, lib: str) -> str:
    """``LD_PRELOAD`` with ``lib`` first, as TMS composes it."""
    return f"{lib}:{current}" if current else lib


@contextmanager
def configure_subprocess() -> Iterator[None]:
    """Configure environment variables for subprocesses. Only needed for hook_mode=preload."""
    lib = preload_library()
    if lib is None:
        logger.warning(
            "torpor.tms: configure_subprocess(): torpor's preload library (%s) is not built; LD_PRELOAD is left as "
            "it is, and children tag what torch allocates inside region() through torpor's pools",
            PRELOAD_NAME,
        )
        yield
        return
    old = os.environ.get(LD_PRELOAD)
    new = prepended(old or "", str(lib))
    os.environ[LD_PRELOAD] = new
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(LD_PRELOAD, None)
        else:
            os.environ[LD_PRELOAD] = old
