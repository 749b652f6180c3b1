"""The driver under the allocator, as Python sees it: a view over the native library's driver table.

The native library (csrc/) holds one driver table per driver: the CUDA driver opened with ``dlopen``
(csrc/driver_cuda.c) or a simulated device (csrc/driver_sim.c, csrc/sim_host.c). The allocation table
makes the VMM calls (reserve, create, map, set access, unmap, release) there; this view makes the
rest (host memory, copies, events, synchronize, mem info) through the same table with ctypes, which
lets go of the GIL around each call. Nothing raises across the C boundary: each call returns a code,
and the view builds the :class:`~torpor.errors.DriverError` (the call, the reason, the driver's code)
and raises it. Two views: :class:`~torpor.allocator.native.cuda_driver.CudaDriver` and
:class:`~torpor.allocator.native.sim_driver.SimDriver`. Every call of the view goes through one choke point,
:meth:`Driver.invoke`, so a simulated driver can record and fail any of them. :data:`CALL_TABLE` is
the one place that says, for every call, its id in the library, whether the table or this view makes
it, and the library function the view calls (resolved once per library). Host pointers and events are plain
integers the driver hands out; the allocator never looks inside them. Every length, address and device
is checked before it is passed on (:func:`~torpor.allocator.native.library.check_range` and its
siblings): a negative or huge length, or a range past 2**64 - 1, is refused by value with
:class:`~torpor.errors.AllocatorArgumentError` before anything is called or recorded.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

from torpor.allocator.native import library as native
from torpor.allocator.native.headroom import host_headroom
from torpor.allocator.native.library import check_address, check_device, check_length, check_range
from torpor.errors import BadArgument, DriverError, DriverOutOfMemory


def driver_error(err: native.TpErr, call: str) -> DriverError:
    """The error for a driver call the library reported failed (out of memory: DriverOutOfMemory)."""
    cls = DriverOutOfMemory if err.oom else DriverError
    return cls(err.call.decode() or call, err.msg.decode(errors="replace") or "failed", err.code)


class DriverCall(NamedTuple):
    """One call of the driver table: its id in the library, who makes it, and the library function this view calls."""

    call_id: int | None
    """Its id in the library (the ``TP_*`` call ids of csrc/tp.h: the simulator logs and fails calls by it);
    None: a library call of the view that is no driver call (never logged nor failed)."""
    by_table: bool
    """The allocation table makes it, in C, through the driver table (``tp_driver``)."""
    symbol: str | None
    """The library function this view calls for it (csrc/drv.c's ``tp_drv_*``); None: only the table makes it."""


CALL_TABLE: dict[str, DriverCall] = {
    # name: DriverCall(id in csrc/tp.h, made by the table, the view's library function)
    "granularity": DriverCall(0, True, "tp_drv_granularity"),
    "reserve": DriverCall(1, True, None),
    "unreserve": DriverCall(2, True, None),
    "create": DriverCall(3, True, None),
    "map": DriverCall(4, True, None),
    "set_access": DriverCall(5, True, None),
    "unmap": DriverCall(6, True, None),
    "release": DriverCall(7, True, None),
    "host_reserve": DriverCall(8, False, "tp_drv_host_reserve"),
    "host_alloc": DriverCall(9, False, "tp_drv_host_alloc"),
    "host_free": DriverCall(10, False, "tp_drv_host_free"),
    "host_unreserve": DriverCall(11, False, "tp_drv_host_unreserve"),
    "copy_d2h": DriverCall(12, False, "tp_drv_copy_d2h"),
    "copy_h2d": DriverCall(13, False, "tp_drv_copy_h2d"),
    "record": DriverCall(14, False, "tp_drv_record"),
    "wait": DriverCall(15, True, "tp_drv_wait"),  # the table waits for torch's stream before a free
    "synchronize": DriverCall(16, True, "tp_drv_synchronize"),  # the table synchronizes before a cudaFree's unmap
    "mem_info": DriverCall(17, False, "tp_drv_mem_info"),
    "host_copy": DriverCall(18, False, "tp_drv_host_copy"),
    "host_register": DriverCall(19, False, "tp_drv_host_register"),
    # the view's other library calls: no driver calls of the simulator's count
    "ensure_context": DriverCall(None, False, "tp_drv_ensure_context"),
    "prepare_device": DriverCall(None, False, "tp_drv_prepare_device"),
    "prepare_thread": DriverCall(None, False, "tp_drv_prepare_thread"),
    "read": DriverCall(None, False, "tp_drv_read"),
    "write": DriverCall(None, False, "tp_drv_write"),
}
"""Every call the driver table makes, by name: the one place that says who makes it and in which C function.

A call the view makes is a public method of :class:`Driver` that checks its values and goes through
:meth:`Driver.invoke`, which runs ``Driver._<name>`` (where a subclass or a test overrides it), which
calls ``symbol`` on the driver table. The library's own calls of the table's entries are in csrc/table.c,
sleep.c and trim.c (``c->drv.<name>``); each driver's entries are in csrc/driver_cuda.c and driver_sim.c.
"""


_DRIVER_CALLS = {c.call_id: n for n, c in CALL_TABLE.items() if c.call_id is not None}
_METHODS = {n: "_" + n for n, c in CALL_TABLE.items() if c.call_id is not None and c.symbol is not None}


def not_a_view_call(call: str) -> BadArgument:
    """The refusal of a driver call this view does not make, naming those it makes."""
    entry = CALL_TABLE.get(call)
    if entry is not None and entry.call_id is not None:
        why = "the allocation table makes it, in C"
    elif entry is not None:
        why = f"it is no driver call (Driver.{call}() calls the library directly)"
    else:
        why = "there is no such driver call"
    msg = f"the driver view cannot invoke {call!r}: {why}; it invokes {', '.join(_METHODS)}"
    return BadArgument(msg)


class Driver(ABC):
    """Mechanism the :class:`~torpor.allocator.TaggedAllocator` drives; one instance per process."""

    CALLS: ClassVar[tuple[str, ...]] = tuple(_DRIVER_CALLS[i] for i in sorted(_DRIVER_CALLS))
    """Every driver call by name, at its id (csrc/tp.h): ``CALLS[CALL_TABLE[name].call_id] == name``."""

    VIEW_CALLS: ClassVar[tuple[str, ...]] = tuple(_METHODS)
    """The driver calls this view makes (each a public method and an ``_``-prefixed implementation)."""

    name: ClassVar[str] = "driver"
    _lib: Any = None

    _functions: dict[str, Any]  # call name -> its library function (CALL_TABLE's symbol), resolved from `lib`

    @property
    def is_cuda(self) -> bool:
        """Whether this is CUDA's driver (a real GPU: torch's pools, device kernels), not the simulated device."""
        return self.name == "cuda"

    @property
    def lib(self) -> Any:
        """The native library (set by :meth:`_table`; a test may put a proxy of it here).

        Setting it resolves the library function of every call in :data:`CALL_TABLE` once.
        """
        return self._lib

    @lib.setter
    def lib(self, lib: Any) -> None:
        self._lib = lib
        self._functions = {} if lib is None else {n: getattr(lib, c.symbol) for n, c in CALL_TABLE.items() if c.symbol}

    def invoke(self, call: str, *args: Any) -> Any:
        """The one choke point: run driver call ``call`` (a name in :attr:`VIEW_CALLS`) with ``args``.

        It runs ``self._<call>`` (the implementation a subclass or a test may override); a call this
        view does not make is refused (:class:`~torpor.errors.BadArgument` naming those it makes).
        """
        method = _METHODS.get(call)
        if method is None:
            raise not_a_view_call(call)
        return getattr(self, method)(*args)

    @abstractmethod
    def _table(self) -> int:
        """The library's driver table (a ``tp_driver *``), opened on first use; sets :attr:`lib`."""

    def _c(self, call: str, *args: Any) -> None:
        """``call``'s library function (:data:`CALL_TABLE`) on the driver table; its failure raised as a DriverError."""
        table = self._table()
        err = native.TpErr()
        if self._functions[call](table, *args, ctypes.byref(err)) != 0:
            raise driver_error(err, call)

    # -- the public calls (each goes through invoke) ------------------------------

    def granularity(self, device: int) -> int:
        """Mapping granularity in bytes on ``device`` (sizes and addresses are multiples of it)."""
        return int(self.invoke("granularity", check_device(device, "granularity")))

    def host_reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of host address space (nothing faulted in or pinned); return its start.

        Pieces of it are pinned one by one with ``host_alloc(n, host=...)``; a
        piece never pinned goes back with :meth:`host_unreserve`.
        """
        return int(self.invoke("host_reserve", check_length(nbytes, "host_reserve", least=1)))

    def host_alloc(self, nbytes: int, host: int | None = None) -> int:
        """Pin ``nbytes`` of host memory (fresh, or the reserved range at ``host``); return its address.

        The pages are faulted in by this call and may be written (zeros): never
        for memory that holds data (that is :meth:`host_register`). A failure
        pins nothing; a reserved range given stays reserved (give it back with
        :meth:`host_unreserve`).
        """
        nbytes = check_length(nbytes, "host_alloc", least=1)
        if host:
            host, _ = check_range(host, nbytes, "host_alloc", what="host", least=1)
        return int(self.invoke("host_alloc", nbytes, host))

    def host_free(self, host: int) -> None:
        """Unpin and unmap host memory from :meth:`host_alloc`."""
        self.invoke("host_free", check_address(host, "host_free", what="host"))

    def host_unreserve(self, host: int, nbytes: int) -> None:
        """Give back reserved host address space that was never pinned."""
        self.invoke("host_unreserve", *check_range(host, nbytes, "host_unreserve", what="host"))

    def copy_d2h(self, host: int, address: int, nbytes: int, device: int) -> None:
        """Enqueue a copy of ``nbytes`` from device ``address`` to ``host`` on ``device``'s copy stream."""
        host, nbytes = check_range(host, nbytes, "copy_d2h", what="host")
        address, _ = check_range(address, nbytes, "copy_d2h")
        self.invoke("copy_d2h", host, address, nbytes, check_device(device, "copy_d2h"))

    def copy_h2d(self, address: int, host: int, nbytes: int, device: int) -> None:
        """Enqueue a copy of ``nbytes`` from ``host`` to device ``address`` on ``device``'s copy stream."""
        address, nbytes = check_range(address, nbytes, "copy_h2d")
        host, _ = check_range(host, nbytes, "copy_h2d", what="host")
        self.invoke("copy_h2d", address, host, nbytes, check_device(device, "copy_h2d"))

    def record(self, device: int) -> object:
        """Record an event after the copies enqueued so far on ``device``'s copy stream."""
        return self.invoke("record", check_device(device, "record"))

    def wait(self, event: object) -> None:
        """Block until ``event`` completed (raises the copy's error if one failed); the event is spent."""
        self.invoke("wait", event)

    def synchronize(self, device: int) -> None:
        """Block until all work on ``device`` (every stream) is done."""
        self.invoke("synchronize", check_device(device, "synchronize"))

    def mem_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        free, total = self.invoke("mem_info", check_device(device, "mem_info"))
        return int(free), int(total)

    def host_register(self, host: int, nbytes: int) -> None:
        """Pin reserved host memory that already holds data (never written here); freed with :meth:`host_free`."""
        self.invoke("host_register", *check_range(host, nbytes, "host_register", what="host", least=1))

    def host_copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` of host memory from pinned ``src`` to reserved ``dst`` (pinned or not); any thread."""
        dst, nbytes = check_range(dst, nbytes, "host_copy", what="dst")
        src, _ = check_range(src, nbytes, "host_copy", what="src")
        self.invoke("host_copy", dst, src, nbytes)

    # -- the implementations: one library call each -------------------------------------

    def _granularity(self, device: int) -> int:
        out = ctypes.c_uint64()
        self._c("granularity", device, ctypes.byref(out))
        return int(out.value)

    def _host_reserve(self, nbytes: int) -> int:
        out = ctypes.c_uint64()
        self._c("host_reserve", nbytes, ctypes.byref(out))
        return int(out.value)

    def _host_alloc(self, nbytes: int, host: int | None) -> int:
        return self._pin(nbytes, host, write=False)

    def _pin(self, nbytes: int, host: int | None, *, write: bool) -> int:
        """Pin (``write``: fault fresh pages in by writing zeros, the host has room for them)."""
        out = ctypes.c_uint64()
        self._c("host_alloc", nbytes, host or 0, int(write), ctypes.byref(out))
        return int(out.value)

    def _host_free(self, host: int) -> None:
        self._c("host_free", host)

    def _host_unreserve(self, host: int, nbytes: int) -> None:
        self._c("host_unreserve", host, nbytes)

    def _copy_d2h(self, host: int, address: int, nbytes: int, device: int) -> None:
        self._c("copy_d2h", host, address, nbytes, device)

    def _copy_h2d(self, address: int, host: int, nbytes: int, device: int) -> None:
        self._c("copy_h2d", address, host, nbytes, device)

    def _record(self, device: int) -> object:
        out = ctypes.c_uint64()
        self._c("record", device, ctypes.byref(out))
        return int(out.value)

    def _wait(self, event: object) -> None:
        self._c("wait", int(event))  # type: ignore[call-overload]

    def _synchronize(self, device: int) -> None:
        self._c("synchronize", device)

    def _mem_info(self, device: int) -> tuple[int, int]:
        free, total = ctypes.c_int64(), ctypes.c_int64()
        self._c("mem_info", device, ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)

    def _host_register(self, host: int, nbytes: int) -> None:
        self._c("host_register", host, nbytes)

    def _host_copy(self, dst: int, src: int, nbytes: int) -> None:
        self._c("host_copy", dst, src, nbytes)

    # -- not driver calls (not in CALLS) ----------------------------------------------------

    def ensure_context(self, device: int) -> None:
        """Make a context for ``device`` current in this thread when none is (no-op off CUDA)."""
        self._c("ensure_context", check_device(device, "ensure_context"))

    def prepare_device(self, device: int) -> None:
        """Make what sleeps on ``device`` will use (context, copy stream) now, while awake (no-op off CUDA).

        A stream holds a little device memory: one made during a sleep would stay on the device while it is asleep.
        """
        self._c("prepare_device", check_device(device, "prepare_device"))

    def prepare_thread(self) -> None:
        """Set up a helper thread (pinning): a context, and no interference with graph captures elsewhere."""
        self._c("prepare_thread")

    def host_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more host pages can be faulted in by writing with room to spare (then counted as taken).

        Not a driver call: the host's MemAvailable and cgroup limits
        (:mod:`torpor.allocator.native.headroom`); a write fault with no room calls the
        OOM killer, where pinning fails with a clear error.
        """
        return host_headroom.claim(nbytes)

    def read(self, address: int, nbytes: int) -> bytes:
        """Read device bytes into a fresh buffer (tests, demos: the slow, synchronous path)."""
        address, nbytes = check_range(address, nbytes, "read")
        buf = ctypes.create_string_buffer(max(nbytes, 1))
        self._c("read", address, buf, nbytes)
        return buf.raw[:nbytes]

    def write(self, address: int, data: bytes) -> None:
        """Write device bytes (tests, demos: the slow, synchronous path)."""
        payload = data if isinstance(data, bytes) else bytes(data)
        address, _ = check_range(address, len(payload), "write")
        self._c("write", address, payload, len(payload))
