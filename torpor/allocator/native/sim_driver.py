"""SimDriver: a simulated device on host memory, with a capacity and failures injectable at any call.

The device is the native library's simulated driver (csrc/driver_sim.c, csrc/sim_host.c), so the
table's C code runs without a GPU: device memory is real memory at real addresses (a reservation a
PROT_NONE mapping, a handle a memfd, a map an mmap of it), so tests check that sleep and wake keep
every byte. The CUDA VMM rules the allocator relies on hold: a mapping needs a reservation and a live
handle, an unmap takes the whole mapped range, a released mapped handle frees its memory at the unmap.
Host memory is plain memory; copies are memmoves after checking both ranges. Host addresses are never
reused unless ``reuse_host`` asks for what mmap does (a piece of a reservation given back is unmapped
at once and the next reservation that fits takes its address, lowest first). This class is the view of
:class:`~torpor.allocator.native.driver.Driver` over that device, plus the simulator's controls:
:meth:`SimDriver.fail` arms the n-th next invocation of any call in :attr:`SimDriver.CALLS`;
:attr:`SimDriver.calls` records every invocation.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, ClassVar

from torpor.allocator.native import library as native
from torpor.allocator.native.driver import CALL_TABLE, Driver, not_a_view_call
from torpor.errors import BadArgument, DriverError, DriverOutOfMemory
from torpor.units import MiB


@dataclass
class SimCall:
    """One recorded driver invocation: its name, and whether it was failed on purpose."""

    call: str
    args: tuple[Any, ...] = ()
    failed: bool = False


class SimDriver(Driver):
    """A simulated device with ``capacity`` bytes per device and ``host_capacity`` bytes of pinned host memory.

    ``overhead``: bytes per device in use outside any handle (a CUDA context, cuBLAS, NCCL on a real GPU).
    ``reuse_host``: host address space given back is reused by the next reservation that fits (as munmap
    then mmap may do); off, every reservation is at a fresh address.
    """

    name = "sim"
    RECORDED_IN_LIBRARY: ClassVar[frozenset[str]] = frozenset({"granularity", "synchronize"})
    """Calls the library itself records and fails (the others are recorded by :meth:`invoke` before they run)."""

    def __init__(
        self,
        capacity: int = 1 << 30,
        *,
        host_capacity: int | None = None,
        granularity: int = 2 * MiB,
        devices: int = 1,
        overhead: int = 0,
        reuse_host: bool = False,
    ) -> None:
        self.lib = native.lib()
        self.native_sim = self.lib.tp_sim_new(devices, capacity, granularity)
        if not self.native_sim:
            msg = (
                f"cannot simulate {devices} device(s) with a granularity of {granularity} (a multiple of the page size)"
            )
            raise BadArgument(msg)
        self._driver = self.lib.tp_drv_sim(self.native_sim)
        self._capacity = capacity
        self._host_capacity = host_capacity if host_capacity is not None else 4 * capacity
        self._overhead = overhead
        self._reuse_host = reuse_host
        self._configure()

    def _table(self) -> int:
        return int(self._driver)

    def _configure(self) -> None:
        self.lib.tp_sim_host_config(self.native_sim, self._host_capacity, self._overhead, int(self._reuse_host))

    @property
    def capacity(self) -> int:
        """Device bytes per simulated device."""
        return self._capacity

    @property
    def host_capacity(self) -> int:
        """Pinned host bytes the simulated host gives."""
        return self._host_capacity

    @property
    def overhead(self) -> int:
        """Device bytes in use outside any handle (a simulated CUDA context, libraries): mem_info counts them."""
        return self._overhead

    @overhead.setter
    def overhead(self, nbytes: int) -> None:
        self._overhead = nbytes
        self._configure()

    @property
    def reuse_host(self) -> bool:
        """Whether host address space given back is reused by the next reservation that fits."""
        return self._reuse_host

    # -- fault injection and inspection ---------------------------------------------

    def fail(self, call: str, nth: int = 1, times: int = 1, *, oom: bool = False, reason: str = "") -> None:
        """Fail the ``nth`` next invocation of ``call`` (and the ``times - 1`` after it); ``oom`` raises out-of-memory."""
        entry = CALL_TABLE.get(call)
        if entry is None or entry.call_id is None:
            msg = f"SimDriver cannot fail {call!r}: it makes only {', '.join(self.CALLS)}"
            raise BadArgument(msg)
        if nth < 1 or times < 1:
            msg = f"nth and times must be >= 1, got nth={nth}, times={times}"
            raise BadArgument(msg)
        why = (reason or "injected failure").encode()[:127]
        if self.lib.tp_sim_fail(self.native_sim, entry.call_id, nth, times, int(oom), why) != 0:
            msg = f"too many armed failures of {call!r} (16 at most)"
            raise BadArgument(msg)

    def drop_handles(self) -> int:
        """Teardown: close every handle a failed release left open (a file descriptor each); the number closed."""
        return int(self.lib.tp_sim_drop_handles(self.native_sim))

    def clear_faults(self) -> None:
        """Disarm every pending injected failure."""
        self.lib.tp_sim_clear_faults(self.native_sim)

    @property
    def calls(self) -> list[SimCall]:
        """Every invocation so far, in order (arguments are not kept)."""
        n = int(self.lib.tp_sim_log(self.native_sim, 0, None, 0))
        buf = ctypes.create_string_buffer(max(n, 1))
        self.lib.tp_sim_log(self.native_sim, 0, buf, n)
        return [SimCall(self.CALLS[b & 0x7F], (), bool(b & 0x80)) for b in buf.raw[:n]]

    def count(self, call: str) -> int:
        """How many times ``call`` was invoked so far."""
        return sum(1 for c in self.calls if c.call == call)

    @property
    def used(self) -> int:
        """Physical bytes held on device 0."""
        return self.used_on(0)

    def used_on(self, device: int) -> int:
        """Physical bytes held on ``device``."""
        return int(self.lib.tp_sim_used(self.native_sim, device))

    def _host_usage(self) -> tuple[int, int]:
        pinned, reserved = ctypes.c_uint64(), ctypes.c_uint64()
        self.lib.tp_sim_host_usage(self.native_sim, ctypes.byref(pinned), ctypes.byref(reserved))
        return int(pinned.value), int(reserved.value)

    @property
    def host_used(self) -> int:
        """Host bytes pinned."""
        return self._host_usage()[0]

    @property
    def host_reserved(self) -> int:
        """Host address space reserved and not yet given back (pinned or not)."""
        return self._host_usage()[1]

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """(start, size) of every current mapping, by address."""
        cap = 4096
        while True:
            starts, sizes = native.u64s(cap), native.u64s(cap)
            n = int(self.lib.tp_sim_mappings(self.native_sim, starts, sizes, cap))
            if n <= cap:
                return [(int(starts[i]), int(sizes[i])) for i in range(n)]
            cap = n

    def invoke(self, call: str, *args: Any) -> Any:
        """Record the call and fail it if armed, then run it.

        ``granularity`` and ``synchronize`` record and fail themselves in the library (as the table's calls
        do: the table synchronizes too, before a free, as ``cudaFree`` does); the others are recorded and
        failed by a library call of their own before they run, so a Ctrl-C between the two (raised when a
        library call returns to Python) lands before the call has any effect.
        """
        entry = CALL_TABLE.get(call)
        if entry is None or entry.symbol is None or entry.call_id is None:
            raise not_a_view_call(call)
        if call not in self.RECORDED_IN_LIBRARY:
            why = ctypes.create_string_buffer(128)
            hit = int(self.lib.tp_sim_hit(self.native_sim, entry.call_id, why, 128))
            if hit == 2:
                raise DriverOutOfMemory(call, f"{why.value.decode(errors='replace')} (out of memory)", 2)
            if hit:
                raise DriverError(call, why.value.decode(errors="replace"), 999)
        return super().invoke(call, *args)
