"""The native allocation table and driver: ``libtorpor_alloc.so`` (plain C, no Python, no torch) loaded with ctypes.

The library owns every allocation, mapping, address arena and slab of a
:class:`~torpor.allocator.TaggedAllocator` under its own mutex, and gives torch
one malloc/free pair per (context, tag) slot, so torch's allocation calls run
without the GIL. Python reads and changes the table only through the calls
below; each takes the library's mutex for its own duration and calls nothing
but the driver (never Python, never torch). ctypes drops the GIL around every
call. The ``tp_drv_*`` calls are the driver table's host-memory, copy and event
calls, for the Python view (:mod:`torpor.allocator.native.driver`). Loading is
lazy: importing this module touches no library, so ``import torpor`` works where
the library was not built.

Values are checked here, before the C boundary, where ctypes would otherwise
wrap them silently (``-1`` bytes is 2**64 - 1, ``2**64 + 4096`` bytes is 4096,
device ``2**32`` is device 0): lengths run from 0 (sizes from 1) to 2**63 - 1,
addresses from 0 to 2**64 - 1, a range ``[address, address + n)`` ends by
2**64 - 1, devices run from 0 to 63. Anything else raises
:class:`~torpor.errors.AllocatorArgumentError` (an ``AllocatorError`` and a
``ValueError``) naming the argument, its value and the range it must lie in, and
nothing changes. The library checks the same again (Note [Lengths and ranges at
the C boundary] in csrc/tp.h), for callers that reach it some other way.
"""

from __future__ import annotations

import ctypes
import operator
import threading
from pathlib import Path
from typing import Any, SupportsIndex

from torpor.errors import AllocatorArgumentError, AllocatorError, AllocatorOutOfMemory
from torpor.switches import env_path

LIB_NAME = "libtorpor_alloc.so"
ACTIVE, FROZEN, RELEASED = 0, 1, 2
#: What the library holds (csrc/tp.h): tags per context, bytes per tag name (a NUL ends it), devices, torch slots per process.
MAX_TAGS, MAX_TAG_BYTES, MAX_DEVICES, SLOTS = 64, 63, 64, 128
#: The longest length and the last address the library takes (TP_MAX_LEN in csrc/tp.h; 2**64 - 1).
MAX_LENGTH, MAX_ADDRESS = (1 << 63) - 1, (1 << 64) - 1
_u64 = ctypes.c_uint64
_p = ctypes.c_void_p
_int = ctypes.c_int


class TpErr(ctypes.Structure):
    """One failure, as the library reports it (``tp_err`` in csrc/tp.h)."""

    _fields_ = [
        ("code", _int),
        ("oom", _int),
        ("tag", _int),
        ("op", ctypes.c_char * 16),
        ("call", ctypes.c_char * 32),
        ("msg", ctypes.c_char * 256),
    ]


_E = ctypes.POINTER(TpErr)
_U = ctypes.POINTER(_u64)
_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "tp_open_cuda": (_p, [_E]),
    "tp_open_sim": (_p, [_p]),
    "tp_configure": (None, [_p, _u64, _u64]),
    "tp_tag_id": (_int, [_p, ctypes.c_char_p]),
    "tp_granularity": (_int, [_p, _int, _U, _E]),
    "tp_alloc_raw": (_int, [_p, _int, _int, _u64, _U, _E]),
    "tp_free_raw": (_int, [_p, _u64, _E]),
    "tp_free_synchronized": (_int, [_p, _u64, _E]),
    "tp_trim": (_int, [_p, _u64, _E]),
    "tp_untrim": (_int, [_p, _u64, _E]),
    "tp_pend": (_int, [_p, _u64, _p, _E]),
    "tp_unpend": (_int, [_p, _u64, _E]),
    "tp_slot_bind": (_int, [_p, _int]),
    "tp_slot_malloc_fn": (_p, [_int]),
    "tp_slot_free_fn": (_p, [_int]),
    "tp_slot_census": (None, [ctypes.POINTER(_int)]),
    "tp_freeze": (_int, [_p, _int, _E]),
    "tp_thaw": (_int, [_p, _int, _E]),
    "tp_unmap_range": (_int, [_p, _int, _u64, _u64, _E]),
    "tp_map_back": (_int, [_p, _int, _U, _U, _int, ctypes.POINTER(_int), _E]),
    "tp_mark_released": (_int, [_p, _int, _E]),
    "tp_map_span": (_int, [_p, _int, _u64, _u64, _int, _E]),
    "tp_unmap_all": (_int, [_p, _int, _E]),
    "tp_mark_awake": (_int, [_p, _int, _E]),
    "tp_list": (_int, [_p, _int, _U, _U, ctypes.POINTER(_int), _int]),
    "tp_usage": (_int, [_p, _int, _U, ctypes.POINTER(_int)]),
    "tp_stats": (None, [_p, _int, _U]),
    "tp_errors": (_int, [_p, _E, _int]),
    "tp_close": (_int, [_p]),
    "tp_test_fail_growth": (None, [_int]),
    "tp_sim_new": (_p, [_int, _u64, _u64]),
    "tp_sim_drop_handles": (_int, [_p]),
    "tp_sim_hit": (_int, [_p, _int, ctypes.c_char_p, ctypes.c_size_t]),
    "tp_sim_fail": (_int, [_p, _int, _int, _int, _int, ctypes.c_char_p]),
    "tp_sim_clear_faults": (None, [_p]),
    "tp_sim_log": (ctypes.c_size_t, [_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]),
    "tp_sim_used": (_u64, [_p, _int]),
    "tp_sim_mappings": (_int, [_p, _U, _U, _int]),
    "tp_sim_accessible": (_u64, [_p, _u64, _u64]),
    "tp_sim_host_config": (None, [_p, _u64, _u64, _int]),
    "tp_sim_host_usage": (None, [_p, _U, _U]),
    "tp_drv_cuda": (_p, [_E]),
    "tp_drv_sim": (_p, [_p]),
    "tp_drv_granularity": (_int, [_p, _int, _U, _E]),
    "tp_drv_ensure_context": (_int, [_p, _int, _E]),
    "tp_drv_prepare_device": (_int, [_p, _int, _E]),
    "tp_drv_prepare_thread": (_int, [_p, _E]),
    "tp_drv_host_reserve": (_int, [_p, _u64, _U, _E]),
    "tp_drv_host_alloc": (_int, [_p, _u64, _u64, _int, _U, _E]),
    "tp_drv_host_register": (_int, [_p, _u64, _u64, _E]),
    "tp_drv_host_free": (_int, [_p, _u64, _E]),
    "tp_drv_host_unreserve": (_int, [_p, _u64, _u64, _E]),
    "tp_drv_host_copy": (_int, [_p, _u64, _u64, _u64, _E]),
    "tp_drv_copy_d2h": (_int, [_p, _u64, _u64, _u64, _int, _E]),
    "tp_drv_copy_h2d": (_int, [_p, _u64, _u64, _u64, _int, _E]),
    "tp_drv_record": (_int, [_p, _int, _U, _E]),
    "tp_drv_wait": (_int, [_p, _u64, _E]),
    "tp_drv_synchronize": (_int, [_p, _int, _E]),
    "tp_drv_mem_info": (_int, [_p, _int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), _E]),
    "tp_drv_read": (_int, [_p, _u64, _p, _u64, _E]),
    "tp_drv_write": (_int, [_p, _u64, ctypes.c_char_p, _u64, _E]),
    "tp_host_pages_methods": (None, [_int, _int, ctypes.POINTER(_int), ctypes.POINTER(_int)]),
    "tp_host_pages_reserve": (_int, [_u64, _U, _E]),
    "tp_host_pages_fault": (_int, [_u64, _u64, _int, ctypes.POINTER(_int), _E]),
    "tp_host_pages_free": (_int, [_u64, _u64, _E]),
}
_loaded: dict[str, ctypes.CDLL] = {}
_load_lock = threading.Lock()


def library_path() -> Path:
    """Where the library is looked for: ``$TORPOR_NATIVE_LIB``, else next to this module."""
    return env_path("TORPOR_NATIVE_LIB") or Path(__file__).with_name(LIB_NAME)


def lib() -> ctypes.CDLL:
    """The loaded library (loaded once); a clear error when it was not built."""
    found = _loaded.get("lib")
    if found is not None:
        return found
    with _load_lock:
        if "lib" not in _loaded:
            path = library_path()
            if not path.exists():
                msg = (
                    f"torpor's native allocator {path} is not built: install torpor with pip (it compiles the C "
                    "library; needs a C compiler such as gcc), or run `python setup.py build_ext --inplace` in a checkout"
                )
                raise AllocatorError("load", None, msg)
            loaded = ctypes.CDLL(str(path))  # CDLL: every call drops the GIL
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(loaded, name)
                fn.restype = restype
                fn.argtypes = argtypes
            _loaded["lib"] = loaded
    return _loaded["lib"]


def error_of(err: TpErr, tag: str | None) -> AllocatorError:
    """The allocator error for a failure the library reported (out of memory: AllocatorOutOfMemory)."""
    op = err.op.decode() or "allocate"
    call = err.call.decode() or None
    reason = err.msg.decode(errors="replace") or "failed"
    cls = AllocatorOutOfMemory if err.oom else AllocatorError
    return cls(op, tag, reason, call=call)


def u64s(n: int) -> Any:
    """A ctypes array of ``n`` unsigned 64-bit integers."""
    return (_u64 * max(n, 1))()


# -- values before the C boundary (see the module docstring) ----------------------------------------


def integer(value: object, what: str, op: str, tag: str | None = None) -> int:
    """``value`` as an int (bool refused: ``allocate(True)`` is a mistake, not one byte)."""
    if not isinstance(value, bool) and isinstance(value, SupportsIndex):  # ints, numpy integers
        return operator.index(value)
    msg = f"{what} {value!r} refused: it must be an integer, not {type(value).__name__}"
    raise AllocatorArgumentError(op, tag, msg)


def check_length(nbytes: object, op: str, *, what: str = "nbytes", least: int = 0, tag: str | None = None) -> int:
    """A byte count from ``least`` (0 or 1) to 2**63 - 1, else AllocatorArgumentError naming ``what`` and its value."""
    n = integer(nbytes, what, op, tag)
    if not least <= n <= MAX_LENGTH:
        kind = "a length" if least == 0 else "a size"
        msg = f"{what} {n} refused: {kind} is an integer from {least} to 2**63 - 1"
        raise AllocatorArgumentError(op, tag, msg)
    return n


def check_address(address: object, op: str, tag: str | None = None, *, what: str = "address") -> int:
    """An address (0 to 2**64 - 1), else AllocatorArgumentError naming ``what`` and its value."""
    a = integer(address, what, op, tag)
    if not 0 <= a <= MAX_ADDRESS:
        msg = f"{what} {a:#x} refused: an address is an integer from 0 to 2**64 - 1"
        raise AllocatorArgumentError(op, tag, msg)
    return a


def check_range(
    address: object,
    nbytes: object,
    op: str,
    *,
    what: str = "address",
    length: str = "nbytes",
    least: int = 0,
    tag: str | None = None,
) -> tuple[int, int]:
    """``(address, nbytes)`` of a range ``[address, address + nbytes)`` that ends by 2**64 - 1, else AllocatorArgumentError."""
    a = check_address(address, op, tag, what=what)
    n = check_length(nbytes, op, what=length, least=least, tag=tag)
    if n > MAX_ADDRESS - a:
        msg = f"{what} range {a:#x}+{n} refused: it runs past 2**64 - 1, the last address"
        raise AllocatorArgumentError(op, tag, msg)
    return a, n


def check_device(device: object, op: str = "allocate", tag: str | None = None) -> int:
    """A device index the library takes (0 to 63), else AllocatorArgumentError naming it."""
    d = integer(device, "device", op, tag)
    if not 0 <= d < MAX_DEVICES:
        msg = f"device {d} refused: devices are numbered 0 to {MAX_DEVICES - 1}"
        raise AllocatorArgumentError(op, tag, msg)
    return d
