"""``_impl._binary_wrapper``: TMS's C entry points, in torpor's preload library, typed as TMS types them.

TMS's tests and some of its users reach the saver's configuration through
``torch_memory_saver._impl._binary_wrapper.cdll`` (``tms_get_current_tag()``,
``tms_get_cpu_backup_backend()``, ``tms_pause(None)``...). torpor's preload
library exports the same functions (csrc/tms_preload.c): the per-thread region
settings live there, as in TMS, and ``tms_pause``, ``tms_resume`` and
``tms_get_cpu_backup_pointer`` call back into torpor.tms through the ctypes
callbacks :meth:`BinaryWrapper.register` installs, so a pause from C is the
same logged sleep as one from Python. Names the library does not define
(``cudaHostGetFlags``, ``cudaGetLastError``: TMS's library links the CUDA
runtime) resolve in the CUDA runtime this process loaded.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torpor.tms.preload import PRELOAD_NAME, preload_library

logger = logging.getLogger("torpor.tms")

_B, _P, _S, _U64 = ctypes.c_bool, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint64
#: Every C entry point: name -> (argument types, result type), as TMS's binary_wrapper declares them.
SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "tms_set_current_tag": ([_P], None),
    "tms_get_current_tag": ([], _P),
    "tms_set_interesting_region": ([_B], None),
    "tms_get_interesting_region": ([], _B),
    "tms_set_enable_cpu_backup": ([_B], None),
    "tms_get_enable_cpu_backup": ([], _B),
    "tms_set_cpu_backup_backend": ([_P], None),
    "tms_get_cpu_backup_backend": ([], _P),
    "tms_set_enable_disk_backup": ([_B], None),
    "tms_get_enable_disk_backup": ([], _B),
    "tms_set_disk_backup_dir": ([_P], None),
    "tms_pause": ([_P], _S),
    "tms_resume": ([_P], _S),
    "set_memory_margin_bytes": ([_U64], None),
    "tms_set_retain_cpu_backup": ([_B], None),
    "tms_get_retain_cpu_backup": ([], _B),
    "tms_get_cpu_backup_pointer": ([ctypes.POINTER(ctypes.c_uint8), _U64], ctypes.POINTER(ctypes.c_uint8)),
    "tmsp_register": ([ctypes.c_void_p, ctypes.c_void_p], None),
    "tmsp_get_disk_backup_dir": ([ctypes.c_char_p, _S], _S),
    "tmsp_get_memory_margin_bytes": ([], _U64),
    "tmsp_ctx": ([], ctypes.c_void_p),
}
COMMAND = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p)  # op (0 pause, 1 resume), tag or NULL
POINTER = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64)  # device address, bytes -> host


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with every entry point of :data:`SIGNATURES` typed."""
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = result
    return lib


def _cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded (torch's), found in /proc/self/maps; None before it is loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    return ctypes.CDLL(sorted(paths)[0]) if paths else None


class TmsLibrary:
    """The library as TMS's ``cdll``: its own functions first, then the process's CUDA runtime's (see the module docstring)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._lib, name)
        except AttributeError:
            pass
        for source in (ctypes.CDLL(None), _cuda_runtime()):
            fn = getattr(source, name, None) if source is not None else None
            if fn is not None:
                setattr(self, name, fn)
                return fn
        msg = f"torpor's preload library ({PRELOAD_NAME}) and the CUDA runtime define no {name!r}"
        raise AttributeError(msg)


class BinaryWrapper:
    """TMS's ``BinaryWrapper`` over torpor's library: ``cdll``, ``set_config``, and torpor's callbacks."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.cdll = TmsLibrary(typed(lib))
        self._callbacks: tuple[Any, Any] | None = None

    def set_config(
        self,
        *,
        tag: str,
        interesting_region: bool,
        enable_cpu_backup: bool,
        cpu_backup_backend: str | None = None,
        enable_disk_backup: bool = False,
    ) -> None:
        """This thread's region settings, as TMS sets them (a backend of None keeps the current one)."""
        c = self.cdll
        c.tms_set_current_tag(tag.encode("utf-8"))
        c.tms_set_interesting_region(interesting_region)
        c.tms_set_enable_cpu_backup(enable_cpu_backup)
        if cpu_backup_backend is not None:
            c.tms_set_cpu_backup_backend(cpu_backup_backend.encode("utf-8"))
        c.tms_set_enable_disk_backup(enable_disk_backup)

    def config(self) -> dict[str, Any]:
        """This thread's region settings now (the keyword arguments of :meth:`set_config`)."""
        c = self.cdll
        return {
            "tag": c.tms_get_current_tag().decode("utf-8"),
            "interesting_region": bool(c.tms_get_interesting_region()),
            "enable_cpu_backup": bool(c.tms_get_enable_cpu_backup()),
            "cpu_backup_backend": c.tms_get_cpu_backup_backend().decode("utf-8"),
            "enable_disk_backup": bool(c.tms_get_enable_disk_backup()),
        }

    def backend(self) -> str:
        """This thread's CPU backup backend (``TMS_INIT_CPU_BACKUP_BACKEND`` until a region sets another)."""
        return str(self.cdll.tms_get_cpu_backup_backend().decode("utf-8"))

    def disk_backup_dir(self) -> str:
        """The disk backup directory (``TMS_DISK_BACKUP_DIR``, default /tmp, until set)."""
        buf = ctypes.create_string_buffer(4096)
        self.cdll.tmsp_get_disk_backup_dir(buf, len(buf))
        return buf.value.decode("utf-8")

    def early_context(self) -> int | None:
        """The native table the library opened itself at the process's first cudaMalloc (TMS_INIT_ENABLE=1), or None."""
        return self.cdll.tmsp_ctx() or None

    def register(self, command: Callable[[str, str | None], None], pointer: Callable[[int, int], int | None]) -> None:
        """``tms_pause``/``tms_resume`` call ``command("pause"|"resume", tag)``; the backup lookup calls ``pointer``."""

        def on_command(op: int, tag: bytes | None) -> int:
            try:
                command("resume" if op else "pause", tag.decode("utf-8") if tag else None)
            except Exception:  # C has no exceptions: said here, reported as a status (TMS returns one too)
                logger.exception("torpor.tms: %s from C failed", "tms_resume" if op else "tms_pause")
                return 1
            return 0

        def on_pointer(address: int, nbytes: int) -> int:
            try:
                return pointer(address, nbytes) or 0
            except Exception:
                logger.exception("torpor.tms: tms_get_cpu_backup_pointer failed")
                return 0

        callbacks = (COMMAND(on_command), POINTER(on_pointer))
        self.cdll.tmsp_register(ctypes.cast(callbacks[0], ctypes.c_void_p), ctypes.cast(callbacks[1], ctypes.c_void_p))
        self._callbacks = callbacks  # kept alive as long as C may call them


def load(path: Path | None = None) -> BinaryWrapper | None:
    """The wrapper over the library at ``path`` (default: torpor's built one); None when it is not built."""
    lib_path = path if path is not None else preload_library()
    if lib_path is None:
        return None
    return BinaryWrapper(ctypes.CDLL(str(lib_path)))


@functools.cache
def process_wrapper() -> BinaryWrapper | None:
    """This process's wrapper (the library's state is the process's: one wrapper), None when the library is not built."""
    return load()


def register_default(saver: Callable[[], Any]) -> None:
    """Before the saver starts: C callers' ``tms_pause``/``tms_resume`` start ``saver()`` (the singleton) and go to it."""
    wrapper = process_wrapper()
    if wrapper is None:
        return

    def command(op: str, tag: str | None) -> None:
        getattr(saver(), op)(tag)

    def pointer(address: int, nbytes: int) -> int | None:
        return saver()._ensure_initialized().cpu_backup_pointer(address, nbytes)  # type: ignore[no-any-return]

    wrapper.register(command, pointer)


def preloaded_here(environ: dict[str, str] | None = None) -> bool:
    """Whether this process started with torpor's preload library on ``LD_PRELOAD``."""
    return PRELOAD_NAME in (os.environ if environ is None else environ).get("LD_PRELOAD", "")


__all__ = ["COMMAND", "POINTER", "SIGNATURES", "BinaryWrapper", "TmsLibrary", "load", "process_wrapper", "typed"]
