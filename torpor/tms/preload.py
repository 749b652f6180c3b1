"""torpor's preload library: ``configure_subprocess()`` puts it on ``LD_PRELOAD`` as TMS does, and :class:`PreloadHook` drives it.

TMS prepends its ``torch_memory_saver_hook_mode_preload*.so`` (``LIB:REST``, or
``LIB`` alone) for the duration of the block and restores the old value after.
torpor does the same with its own library, whose name also contains
``torch_memory_saver`` (code that looks for that string on ``LD_PRELOAD``
finds it). Where that library is not built (no C compiler at install), the
block changes nothing and says so: torpor's preload mode then tags what torch
allocates inside ``region()`` through torpor's pools, as its torch mode does.

In a process that has the library on ``LD_PRELOAD``, :class:`PreloadHook` binds
it to the allocator's native table and sets each thread's tag (a region, or
``disable()``) and the process default (``TMS_INIT_ENABLE=1``), so raw
``cudaMalloc`` is tagged and pausable (csrc/tms_preload.c). Being named on
``LD_PRELOAD`` is not enough: :func:`preloaded` asks the dynamic linker what
``cudaMalloc`` resolves to in this process, and where another library wins
(an interposer before torpor's on the list) or torpor's was never preloaded
(the variable changed after the process started), it binds nothing and says
which library answers: raw ``cudaMalloc`` is then not tagged, and no pause
frees it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from _ctypes import CFuncPtr
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from torpor.allocator import NativeEntry

logger = logging.getLogger("torpor.tms")

PRELOAD_NAME = "libtorpor_torch_memory_saver_preload.so"
LD_PRELOAD = "LD_PRELOAD"
INHERIT = -1  # a thread outside any region: the process default
OFF = -2  # a thread inside disable(): the real cudaMalloc


def preload_library() -> Path | None:
    """The path of torpor's preload library, None when it is not built."""
    path = Path(__file__).resolve().parent / PRELOAD_NAME
    return path if path.is_file() else None


def prepended(current: str, lib: str) -> str:
    """``LD_PRELOAD`` with ``lib`` first, as TMS composes it."""
    return f"{lib}:{current}" if current else lib


@contextmanager
def configure_subprocess() -> Iterator[None]:
    """Within the block, processes started get torpor's preload library on ``LD_PRELOAD`` (hook_mode "preload" needs it)."""
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


def preloaded(environ: Mapping[str, str] | None = None) -> ctypes.CDLL | None:
    """torpor's preload library when this process has it on ``LD_PRELOAD`` and its ``cudaMalloc`` is the one that answers.

    None when ``LD_PRELOAD`` does not name it, and, with a warning naming what
    answers instead, when another library's ``cudaMalloc`` shadows it or it was
    not preloaded into this process.
    """
    lib = preload_library()
    entries = (os.environ if environ is None else environ).get(LD_PRELOAD, "").replace(" ", ":").split(":")
    if lib is None or not any(e and os.path.realpath(e) == str(lib) for e in entries):
        return None
    loaded = load(lib)
    winner = shadowing(loaded)
    if winner is None:
        return loaded
    listed = {os.path.realpath(e) for e in entries if e}
    if winner and os.path.realpath(winner) in listed:
        logger.warning(
            "torpor.tms: preload mode is off: cudaMalloc resolves to %s, which comes before torpor's %s on LD_PRELOAD "
            "and shadows it; raw cudaMalloc is not tagged and no pause frees it (put torpor's library first: "
            "configure_subprocess() does)",
            winner,
            lib,
        )
    else:
        logger.warning(
            "torpor.tms: preload mode is off: %s is named on LD_PRELOAD but was not preloaded into this process "
            "(LD_PRELOAD set after it started; cudaMalloc resolves to %s); raw cudaMalloc is not tagged and no pause "
            "frees it",
            lib,
            winner or "no library",
        )
    return None


class _DlInfo(ctypes.Structure):
    """glibc's ``Dl_info``: what ``dladdr`` says of an address."""

    _fields_ = (
        ("dli_fname", ctypes.c_char_p),  # the file of the object holding the address
        ("dli_fbase", ctypes.c_void_p),  # where that object is loaded
        ("dli_sname", ctypes.c_char_p),  # the nearest symbol's name
        ("dli_saddr", ctypes.c_void_p),  # the nearest symbol's address
    )


def _address(fn: CFuncPtr) -> int | None:
    """The address of a ctypes function pointer."""
    return ctypes.cast(fn, ctypes.c_void_p).value


def _file_of(address: int) -> str:
    """The file of the loaded object that holds ``address`` (``dladdr``), or the address itself when none says."""
    process = ctypes.CDLL(None)
    dladdr = getattr(process, "dladdr", None) or ctypes.CDLL("libdl.so.2").dladdr  # libc since glibc 2.34
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    info = _DlInfo()
    if dladdr(ctypes.c_void_p(address), ctypes.byref(info)) and info.dli_fname:
        return os.fsdecode(info.dli_fname)
    return f"the code at {address:#x}"


def shadowing(lib: ctypes.CDLL, symbol: str = "cudaMalloc") -> str | None:
    """Who answers ``symbol`` in this process instead of ``lib``: None when ``lib``'s own does.

    The dynamic linker resolves a call by name to the first object of the global
    scope that defines it (``dlsym`` on the process's handle asks the same): the
    file of that object when it is not ``lib``'s, ``""`` when no object there
    defines it (``lib`` was loaded by ``dlopen``, not preloaded).
    """
    try:
        answers = _address(getattr(ctypes.CDLL(None), symbol))
    except AttributeError:
        return ""
    if answers == _address(getattr(lib, symbol)):
        return None
    return "" if answers is None else _file_of(answers)


def load(path: Path) -> ctypes.CDLL:
    """The preload library at ``path`` with its functions' types (already loaded when it is on LD_PRELOAD)."""
    lib = ctypes.CDLL(str(path))
    lib.tmsp_bind.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.tmsp_bind.restype = None
    lib.tmsp_set_tag.argtypes = [ctypes.c_int]
    lib.tmsp_set_tag.restype = ctypes.c_int
    lib.tmsp_get_tag.restype = ctypes.c_int
    lib.tmsp_set_default_tag.argtypes = [ctypes.c_int]
    lib.tmsp_set_default_tag.restype = None
    lib.tmsp_live.restype = ctypes.c_int
    lib.tmsp_served.restype = ctypes.c_uint64
    lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.cudaMalloc.restype = ctypes.c_int
    lib.cudaFree.argtypes = [ctypes.c_void_p]
    lib.cudaFree.restype = ctypes.c_int
    return lib


class PreloadHook:
    """The preload library bound to one allocator's native table: which tag each thread's raw cudaMalloc gets."""

    def __init__(self, lib: ctypes.CDLL, table: NativeEntry) -> None:
        self.lib = lib
        self.table = table
        # cudaFree waits for the device: the synchronized free
        lib.tmsp_bind(ctypes.c_void_p(table.context), table.alloc_raw, table.free_synchronized)
        logger.info("torpor.tms: preload mode: raw cudaMalloc inside regions goes to torpor's table")

    @contextmanager
    def tagged(self, tag: str | None) -> Iterator[None]:
        """This thread's raw cudaMalloc goes to torpor tag ``tag`` inside the block (None: the real runtime)."""
        previous = self.lib.tmsp_set_tag(OFF if tag is None else self.table.tag_id(tag))
        try:
            yield
        finally:
            self.lib.tmsp_set_tag(previous)

    def set_default(self, tag: str | None) -> None:
        """Raw cudaMalloc outside any region, in every thread, goes to ``tag`` (None: the real runtime)."""
        self.lib.tmsp_set_default_tag(INHERIT if tag is None else self.table.tag_id(tag))

    def live(self) -> int:
        """Allocations the library handed out from the table and that were not freed yet."""
        return int(self.lib.tmsp_live())
