"""SimDriver: a simulated device on host memory, with a capacity and failures injectable at any call.

The device is the native library's simulated driver (csrc/driver_sim.c), so the table's C code runs
without a GPU: device memory is real memory at real addresses (a reservation a PROT_NONE mapping, a
handle a memfd, a map an mmap of it), so tests check that sleep and wake keep every byte. The CUDA VMM
rules the allocator relies on hold: a mapping needs a reservation and a live handle, an unmap takes the
whole mapped range, a released mapped handle frees its memory at the unmap. Host memory is plain memory;
copies are memmoves after checking both ranges. Host addresses are never reused unless ``reuse_host``
asks for what mmap does (a piece of a reservation given back is unmapped at once and the next
reservation that fits takes its address, lowest first). :meth:`SimDriver.fail` arms the n-th next
invocation of any call in :attr:`SimDriver.CALLS`; :attr:`SimDriver.calls` records every invocation.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import mmap
import threading
from dataclasses import dataclass
from typing import Any

from torpor.allocator.errors import DriverError, DriverOutOfMemory
from torpor.allocator.native import library as native
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.libc import libc as _libc

MiB = 1 << 20
_PAGE = mmap.PAGESIZE
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FRESH = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x100000  # MAP_FIXED_NOREPLACE: never over a live mapping
_MAP_FAILED = ctypes.c_void_p(-1).value
_HOST_BASE = 0x2000_0000_0000  # simulated pinned host memory lives here, at ever higher addresses
_HOST_END = 0x3000_0000_0000


_NATIVE_CALLS = 8  # granularity .. release run in the library; the host and copy calls here


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
            raise ValueError(msg)
        self.capacity = capacity
        self.host_capacity = host_capacity if host_capacity is not None else 4 * capacity
        self._granularity_bytes = granularity
        self._ndev = devices
        self.overhead = overhead  # device bytes in use outside any handle: a simulated CUDA context, libraries
        self._lock = threading.RLock()
        self._buffers: dict[
            int, int
        ] = {}  # start -> bytes of host memory mapped there (a reservation or a fresh buffer)
        self._host_next = _HOST_BASE
        self.reuse_host = reuse_host
        self._host_holes: list[tuple[int, int]] = []  # (start, size) given back, sorted: reused with reuse_host
        self._host_reserved: dict[int, list[int]] = {}  # start -> [size, bytes not yet given back]
        self._pinned: dict[int, int] = {}  # start -> bytes pinned there
        self._host_starts: list[int] = []  # starts of pinned ranges, sorted
        self._events = itertools.count(1)
        self.host_used = 0

    # -- fault injection and inspection ---------------------------------------------

    def fail(self, call: str, nth: int = 1, times: int = 1, *, oom: bool = False, reason: str = "") -> None:
        """Fail the ``nth`` next invocation of ``call`` (and the ``times - 1`` after it); ``oom`` raises out-of-memory."""
        if call not in self.CALLS:
            msg = f"SimDriver cannot fail {call!r}: it makes only {', '.join(self.CALLS)}"
            raise ValueError(msg)
        if nth < 1 or times < 1:
            msg = f"nth and times must be >= 1, got nth={nth}, times={times}"
            raise ValueError(msg)
        why = (reason or "injected failure").encode()[:127]
        if self.lib.tp_sim_fail(self.native_sim, self.CALLS.index(call), nth, times, int(oom), why) != 0:
            msg = f"too many armed failures of {call!r} (16 at most)"
            raise ValueError(msg)

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

    @property
    def host_reserved(self) -> int:
        """Host address space reserved and not yet given back (pinned or not)."""
        with self._lock:
            return sum(left for _, left in self._host_reserved.values())

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
        """Run the call; the library's calls record and fail themselves, this class's are recorded and failed here."""
        index = self.CALLS.index(call)
        if index >= _NATIVE_CALLS:
            why = ctypes.create_string_buffer(128)
            hit = int(self.lib.tp_sim_hit(self.native_sim, index, why, 128))
            if hit == 2:
                raise DriverOutOfMemory(call, f"{why.value.decode(errors='replace')} (out of memory)", 2)
            if hit:
                raise DriverError(call, why.value.decode(errors="replace"), 999)
        return super().invoke(call, *args)

    # -- device memory (in the library) -----------------------------------------------------

    def _native(self, name: str, *args: Any) -> int:
        err = native.TpErr()
        out = ctypes.c_uint64()
        rc = getattr(self.lib, name)(
            self.native_sim, *args, *([ctypes.byref(out)] if name in _OUT else []), ctypes.byref(err)
        )
        if rc != 0:
            call = err.call.decode() or name.removeprefix("tp_sim_")
            cls = DriverOutOfMemory if err.oom else DriverError
            raise cls(call, err.msg.decode(errors="replace"), err.code)
        return int(out.value)

    def _granularity(self, device: int) -> int:
        return self._native("tp_sim_granularity", device)

    def _reserve(self, nbytes: int, device: int) -> int:
        return self._native("tp_sim_reserve", device, nbytes)

    def _unreserve(self, address: int, nbytes: int) -> None:
        self._native("tp_sim_unreserve", address, nbytes)

    def _create(self, nbytes: int, device: int) -> object:
        return self._native("tp_sim_create", device, nbytes)

    def _map(self, address: int, nbytes: int, handle: object) -> None:
        self._native("tp_sim_map", address, nbytes, int(handle))  # type: ignore[call-overload]

    def _set_access(self, address: int, nbytes: int, device: int) -> None:
        self._native("tp_sim_set_access", address, nbytes, device)

    def _unmap(self, address: int, nbytes: int) -> None:
        self._native("tp_sim_unmap", address, nbytes)

    def _release(self, handle: object) -> None:
        self._native("tp_sim_release", int(handle))  # type: ignore[call-overload]

    # -- host memory and copies ------------------------------------------------------------

    def _new_buffer(self, nbytes: int) -> int:
        """Host memory at a fresh address: addresses are never reused (a real unmap/map may, but tests must be stable)."""
        while True:
            address = self._host_next
            self._host_next += (nbytes + 2 * MiB + _PAGE - 1) // _PAGE * _PAGE  # a gap: a copy past the end fails
            got = _libc().mmap(address, nbytes, _PROT_RW, _MAP_FRESH, -1, 0)
            if got == address:
                self._buffers[address] = nbytes
                return address
            if got not in (None, _MAP_FAILED):  # an old kernel took the address as a hint only
                _libc().munmap(got, nbytes)
            if self._host_next > _HOST_END:
                msg = f"the simulated host address space is used up ({nbytes} bytes wanted)"
                raise DriverOutOfMemory("host_alloc", msg, 2)

    def _drop_buffer(self, address: int) -> None:
        nbytes = self._buffers.pop(address, None)
        if nbytes is not None:
            _libc().munmap(address, nbytes)

    def _host_reserve(self, nbytes: int) -> int:
        with self._lock:
            address = self._reuse_hole(nbytes) if self.reuse_host else None
            if address is None:
                address = self._new_buffer(nbytes)
            self._host_reserved[address] = [nbytes, nbytes]
            return address

    def _reuse_hole(self, nbytes: int) -> int | None:
        """Map ``nbytes`` at the lowest given-back address where they fit (what mmap may do); None when none fits."""
        size = (nbytes + _PAGE - 1) // _PAGE * _PAGE
        for i, (start, n) in enumerate(self._host_holes):
            if n < size:
                continue
            got = _libc().mmap(start, size, _PROT_RW, _MAP_FRESH, -1, 0)
            if got != start:
                if got not in (None, _MAP_FAILED):
                    _libc().munmap(got, size)
                continue
            self._host_holes[i : i + 1] = [(start + size, n - size)] if n > size else []
            return start
        return None

    def _give_back_piece(self, start: int, host: int, nbytes: int) -> None:
        """With ``reuse_host``: unmap one piece of the reservation at ``start`` now; its address may be reused."""
        size = self._host_reserved.pop(start)[0]
        self._buffers.pop(start, None)  # the reservation is unmapped piece by piece from now on
        end, cut = start + size, (nbytes + _PAGE - 1) // _PAGE * _PAGE
        for lo, hi in ((start, host), (host + cut, end)):
            if hi > lo:
                self._host_reserved[lo] = [hi - lo, hi - lo]
        _libc().munmap(host, cut)
        holes = sorted([*self._host_holes, (host, cut)])
        merged: list[tuple[int, int]] = []
        for s, n in holes:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._host_holes = merged

    def _reservation(self, host: int, nbytes: int) -> int | None:
        for start, (n, _) in self._host_reserved.items():
            if start <= host and host + nbytes <= start + n:
                return start
        return None

    def _host_alloc(self, nbytes: int, host: int | None) -> int:
        with self._lock:
            if host is not None:
                if self._reservation(host, nbytes) is None:
                    msg = f"host range {host:#x}+{nbytes} is not inside a reservation"
                    raise DriverError("host_alloc", msg, 1)
                if any(s < host + nbytes and host < s + n for s, n in self._pinned.items()):
                    msg = f"host range {host:#x}+{nbytes} is pinned already"
                    raise DriverError("host_alloc", msg, 1)
            if self.host_used + nbytes > self.host_capacity:
                msg = f"cannot pin {nbytes} host bytes: {self.host_used} of {self.host_capacity} pinned"
                raise DriverOutOfMemory("host_alloc", msg, 2)
            if host is None:
                host = self._new_buffer(nbytes)
            self._pinned[host] = nbytes
            bisect.insort(self._host_starts, host)
            self.host_used += nbytes
            return host

    def _host_free(self, host: int) -> None:
        with self._lock:
            nbytes = self._pinned.pop(host, None)
            if nbytes is None:
                msg = f"no pinned host buffer at {host:#x}"
                raise DriverError("host_free", msg, 1)
            self._host_starts.remove(host)
            self.host_used -= nbytes
            if self._reservation(host, nbytes) is None:
                self._drop_buffer(host)  # a fresh buffer: its memory goes
            else:
                self._host_unreserve(host, nbytes)

    def _host_unreserve(self, host: int, nbytes: int) -> None:
        with self._lock:
            start = self._reservation(host, nbytes)
            if start is None:
                return  # a fresh pinned buffer (no reservation), or given back already
            if self.reuse_host:
                self._give_back_piece(start, host, nbytes)
                return
            entry = self._host_reserved[start]
            entry[1] -= nbytes
            if entry[1] <= 0:
                del self._host_reserved[start]
                self._drop_buffer(start)

    def _check_host(self, host: int, nbytes: int, call: str, pageable: bool = False) -> None:
        """Inside one pinned buffer (a copy may not span two, as in CUDA); ``pageable``: or inside a reservation."""
        with self._lock:
            i = bisect.bisect_right(self._host_starts, host) - 1
            if i >= 0:
                start = self._host_starts[i]
                if host + nbytes <= start + self._pinned[start]:
                    return
            if pageable and self._reservation(host, nbytes) is not None:
                return
        msg = f"host range {host:#x}+{nbytes} is not inside {'a host reservation' if pageable else 'a pinned buffer'}"
        raise DriverError(call, msg, 1)

    def _check_device(self, address: int, nbytes: int, call: str) -> None:
        pos = int(self.lib.tp_sim_accessible(self.native_sim, address, nbytes))
        if pos < address + nbytes:
            msg = f"device range {address:#x}+{nbytes} is not mapped and accessible (stops at {pos:#x})"
            raise DriverError(call, msg, 700)

    def _copy_d2h(self, host: int, address: int, nbytes: int, device: int) -> None:
        self._check_host(host, nbytes, "copy_d2h")
        self._check_device(address, nbytes, "copy_d2h")
        ctypes.memmove(host, address, nbytes)

    def _copy_h2d(self, address: int, host: int, nbytes: int, device: int) -> None:
        self._check_host(host, nbytes, "copy_h2d", pageable=True)  # CUDA copies from pageable memory too
        self._check_device(address, nbytes, "copy_h2d")
        ctypes.memmove(address, host, nbytes)

    def _host_register(self, host: int, nbytes: int) -> None:
        SimDriver._host_alloc(self, nbytes, host)  # this pin never writes (a subclass's _host_alloc may model one)

    def _host_copy(self, dst: int, src: int, nbytes: int) -> None:
        self._check_host(src, nbytes, "host_copy")
        self._check_host(dst, nbytes, "host_copy", pageable=True)
        ctypes.memmove(dst, src, nbytes)

    def _device(self, device: int) -> None:
        if not 0 <= device < self._ndev:
            msg = f"no simulated device {device} (have {self._ndev})"
            raise DriverError("device", msg, 101)

    def _record(self, device: int) -> object:
        self._device(device)
        return next(self._events)

    def _wait(self, event: object) -> None:
        return None

    def _synchronize(self, device: int) -> None:
        self._device(device)

    def _mem_info(self, device: int) -> tuple[int, int]:
        self._device(device)
        return self.capacity - self.used_on(device) - self.overhead, self.capacity

    # -- direct access for tests ---------------------------------------------------------

    def read(self, address: int, nbytes: int) -> bytes:
        """The bytes at a mapped, accessible device range."""
        self._check_device(address, nbytes, "read")
        return ctypes.string_at(address, nbytes)

    def write(self, address: int, data: bytes) -> None:
        """Write bytes at a mapped, accessible device range."""
        self._check_device(address, len(data), "write")
        ctypes.memmove(address, data, len(data))


_OUT = frozenset({"tp_sim_granularity", "tp_sim_reserve", "tp_sim_create"})
