"""SimDriver: a simulated device on host memory, with a capacity and failures injectable at any call.

Device memory is real bytes (one ``bytearray`` per physical handle), so tests
can check that sleep and wake keep every byte. The rules follow the CUDA VMM
API where the allocator depends on them: a mapping needs a reservation and a
live handle, an unmap takes the whole mapped range, releasing a mapped handle
frees its memory only at the unmap. Failures: :meth:`SimDriver.fail` arms the
n-th next invocation of any call in :attr:`SimDriver.CALLS`;
:attr:`SimDriver.calls` records every invocation.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

from torpor.allocator.driver import Driver
from torpor.allocator.errors import DriverError, DriverOutOfMemory

MiB = 1 << 20
_VA_BASE = 0x7F00_0000_0000
_HOST_BASE = 0x10_0000_0000


@dataclass
class _Handle:
    id: int
    device: int
    data: bytearray
    mapped: int = 0
    released: bool = False


@dataclass
class _Mapping:
    start: int
    size: int
    handle: _Handle
    offset: int = 0
    accessible: bool = False


@dataclass
class _Fault:
    skip: int
    times: int
    oom: bool
    reason: str = "injected failure"


@dataclass
class SimCall:
    """One recorded driver invocation: its name, arguments, and whether it was failed on purpose."""

    call: str
    args: tuple[Any, ...]
    failed: bool = False


@dataclass
class _Device:
    used: int = 0
    reservations: dict[int, int] = field(default_factory=dict)


class SimDriver(Driver):
    """A simulated device with ``capacity`` bytes per device and ``host_capacity`` bytes of pinned host memory.

    ``overhead``: bytes per device reported in use by :meth:`mem_info` outside
    any handle (what a CUDA context, cuBLAS and NCCL hold on a real GPU).
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
    ) -> None:
        self.capacity = capacity
        self.overhead = overhead  # device bytes in use outside any handle: a simulated CUDA context, libraries
        self.host_capacity = host_capacity if host_capacity is not None else 4 * capacity
        self._granularity_bytes = granularity
        self._devices = [_Device() for _ in range(devices)]
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._va_next = [_VA_BASE + (d << 40) for d in range(devices)]
        self._mappings: dict[int, _Mapping] = {}
        self._starts: list[int] = []
        self._host: dict[int, bytearray] = {}
        self._host_next = _HOST_BASE
        self._host_reserved: dict[int, list[int]] = {}  # start -> [size, bytes not yet given back]
        self.host_used = 0
        self._faults: dict[str, list[_Fault]] = {}
        self.calls: list[SimCall] = []

    # -- fault injection and inspection ---------------------------------------------

    def fail(self, call: str, nth: int = 1, times: int = 1, *, oom: bool = False, reason: str = "") -> None:
        """Fail the ``nth`` next invocation of ``call`` (and the ``times - 1`` after it); ``oom`` raises out-of-memory."""
        if call not in self.CALLS:
            msg = f"SimDriver cannot fail {call!r}: it makes only {', '.join(self.CALLS)}"
            raise ValueError(msg)
        if nth < 1 or times < 1:
            msg = f"nth and times must be >= 1, got nth={nth}, times={times}"
            raise ValueError(msg)
        with self._lock:
            self._faults.setdefault(call, []).append(_Fault(nth - 1, times, oom, reason or "injected failure"))

    def clear_faults(self) -> None:
        """Disarm every pending injected failure."""
        with self._lock:
            self._faults.clear()

    def count(self, call: str) -> int:
        """How many times ``call`` was invoked so far."""
        return sum(1 for c in self.calls if c.call == call)

    @property
    def used(self) -> int:
        """Physical bytes held on device 0."""
        return self._devices[0].used

    def used_on(self, device: int) -> int:
        """Physical bytes held on ``device``."""
        return self._devices[device].used

    @property
    def host_reserved(self) -> int:
        """Host address space reserved and not yet given back (pinned or not)."""
        with self._lock:
            return sum(left for _, left in self._host_reserved.values())

    def mapped_ranges(self) -> list[tuple[int, int]]:
        """(start, size) of every current mapping, by address."""
        with self._lock:
            return [(s, self._mappings[s].size) for s in self._starts]

    def invoke(self, call: str, *args: Any) -> Any:
        """Record the call, fail it if armed, else run it."""
        with self._lock:
            record = SimCall(call, args)
            self.calls.append(record)
            faults = self._faults.get(call, [])
            for fault in list(faults):
                if fault.skip > 0:
                    fault.skip -= 1
                    continue
                fault.times -= 1
                if fault.times <= 0:
                    faults.remove(fault)
                record.failed = True
                if fault.oom:
                    raise DriverOutOfMemory(call, f"{fault.reason} (out of memory)", 2)
                raise DriverError(call, fault.reason, 999)
            return super().invoke(call, *args)

    # -- device memory ---------------------------------------------------------------

    def _granularity(self, device: int) -> int:
        self._device(device)
        return self._granularity_bytes

    def _device(self, device: int) -> _Device:
        if not 0 <= device < len(self._devices):
            msg = f"no simulated device {device} (have {len(self._devices)})"
            raise DriverError("device", msg, 101)
        return self._devices[device]

    def _reserve(self, nbytes: int, device: int) -> int:
        dev = self._device(device)
        self._check_aligned(nbytes, "reserve")
        start = self._va_next[device]
        self._va_next[device] += nbytes + self._granularity_bytes  # a guard gap between reservations
        dev.reservations[start] = nbytes
        return start

    def _unreserve(self, address: int, nbytes: int) -> None:
        for dev in self._devices:
            if dev.reservations.get(address) == nbytes:
                if any(address <= s < address + nbytes for s in self._starts):
                    msg = f"reservation at {address:#x} still has mappings"
                    raise DriverError("unreserve", msg, 1)
                del dev.reservations[address]
                return
        msg = f"no reservation of {nbytes} bytes at {address:#x}"
        raise DriverError("unreserve", msg, 1)

    def _create(self, nbytes: int, device: int) -> object:
        dev = self._device(device)
        self._check_aligned(nbytes, "create")
        if dev.used + nbytes > self.capacity:
            msg = f"cannot create {nbytes} bytes: {dev.used} of {self.capacity} in use on device {device}"
            raise DriverOutOfMemory("create", msg, 2)
        dev.used += nbytes
        return _Handle(next(self._ids), device, bytearray(nbytes))

    def _map(self, address: int, nbytes: int, handle: object) -> None:
        h = self._handle(handle, "map")
        if h.released:
            raise DriverError("map", "handle already released", 1)
        if nbytes != len(h.data):  # cuMemMap's offset must be zero: a handle maps whole
            msg = f"map of {nbytes} bytes with a handle of {len(h.data)}"
            raise DriverError("map", msg, 801)
        dev = self._devices[h.device]
        if not any(s <= address and address + nbytes <= s + n for s, n in dev.reservations.items()):
            msg = f"{address:#x}+{nbytes} is outside every reservation on device {h.device}"
            raise DriverError("map", msg, 1)
        i = bisect.bisect_left(self._starts, address)
        prev_overlaps = i > 0 and self._starts[i - 1] + self._mappings[self._starts[i - 1]].size > address
        next_overlaps = i < len(self._starts) and self._starts[i] < address + nbytes
        if prev_overlaps or next_overlaps:
            msg = f"{address:#x}+{nbytes} overlaps a mapping"
            raise DriverError("map", msg, 1)
        self._starts.insert(i, address)
        self._mappings[address] = _Mapping(address, nbytes, h)
        h.mapped += 1

    def _set_access(self, address: int, nbytes: int, device: int) -> None:
        end = address + nbytes
        covered = address
        for m in self._overlapping(address, nbytes):
            if m.start > covered:
                break
            m.accessible = True
            covered = m.start + m.size
        if covered < end:
            msg = f"set_access on {address:#x}+{nbytes}: not all of it is mapped"
            raise DriverError("set_access", msg, 1)

    def _unmap(self, address: int, nbytes: int) -> None:
        m = self._mappings.get(address)
        if m is None or m.size != nbytes:
            msg = f"no mapping of {nbytes} bytes at {address:#x}"
            raise DriverError("unmap", msg, 1)
        del self._mappings[address]
        self._starts.remove(address)
        m.handle.mapped -= 1
        self._maybe_free(m.handle)

    def _release(self, handle: object) -> None:
        h = self._handle(handle, "release")
        if h.released:
            raise DriverError("release", "handle released twice", 1)
        h.released = True
        self._maybe_free(h)

    def _maybe_free(self, h: _Handle) -> None:
        if h.released and h.mapped == 0 and h.data:
            self._devices[h.device].used -= len(h.data)
            h.data = bytearray()

    # -- host memory and copies ------------------------------------------------------------

    def _host_reserve(self, nbytes: int) -> int:
        address = self._host_next
        self._host_next += nbytes + 2 * MiB  # a gap: a copy past a range's end fails
        self._host_reserved[address] = [nbytes, nbytes]
        return address

    def _reservation(self, host: int, nbytes: int) -> int | None:
        for start, (n, _) in self._host_reserved.items():
            if start <= host and host + nbytes <= start + n:
                return start
        return None

    def _host_alloc(self, nbytes: int, host: int | None) -> int:
        if host is not None:
            if self._reservation(host, nbytes) is None:
                msg = f"host range {host:#x}+{nbytes} is not inside a reservation"
                raise DriverError("host_alloc", msg, 1)
            if any(s < host + nbytes and host < s + len(b) for s, b in self._host.items()):
                msg = f"host range {host:#x}+{nbytes} is pinned already"
                raise DriverError("host_alloc", msg, 1)
        if self.host_used + nbytes > self.host_capacity:
            msg = f"cannot pin {nbytes} host bytes: {self.host_used} of {self.host_capacity} pinned"
            raise DriverOutOfMemory("host_alloc", msg, 2)
        if host is None:
            host = self._host_next
            self._host_next += nbytes + 2 * MiB
        self._host[host] = bytearray(nbytes)
        self.host_used += nbytes
        return host

    def _host_free(self, host: int) -> None:
        buf = self._host.pop(host, None)
        if buf is None:
            msg = f"no pinned host buffer at {host:#x}"
            raise DriverError("host_free", msg, 1)
        self.host_used -= len(buf)
        self._host_unreserve(host, len(buf))

    def _host_unreserve(self, host: int, nbytes: int) -> None:
        start = self._reservation(host, nbytes)
        if start is None:
            return  # a fresh pinned buffer (no reservation), or given back already
        entry = self._host_reserved[start]
        entry[1] -= nbytes
        if entry[1] <= 0:
            del self._host_reserved[start]

    def _host_view(self, host: int, nbytes: int, call: str) -> memoryview:
        for start, buf in self._host.items():
            if start <= host and host + nbytes <= start + len(buf):
                return memoryview(buf)[host - start : host - start + nbytes]
        msg = f"host range {host:#x}+{nbytes} is not inside a pinned buffer"
        raise DriverError(call, msg, 1)

    def _copy_d2h(self, host: int, address: int, nbytes: int, device: int) -> None:
        self._host_view(host, nbytes, "copy_d2h")[:] = self._read(address, nbytes, "copy_d2h")

    def _copy_h2d(self, address: int, host: int, nbytes: int, device: int) -> None:
        self._write(address, bytes(self._host_view(host, nbytes, "copy_h2d")), "copy_h2d")

    def _record(self, device: int) -> object:
        self._device(device)
        return next(self._ids)

    def _wait(self, event: object) -> None:
        return None

    def _synchronize(self, device: int) -> None:
        self._device(device)

    def _mem_info(self, device: int) -> tuple[int, int]:
        dev = self._device(device)
        return self.capacity - dev.used - self.overhead, self.capacity

    # -- direct access for tests ---------------------------------------------------------

    def read(self, address: int, nbytes: int) -> bytes:
        """The bytes at a mapped, accessible device range."""
        with self._lock:
            return self._read(address, nbytes, "read")

    def write(self, address: int, data: bytes) -> None:
        """Write bytes at a mapped, accessible device range."""
        with self._lock:
            self._write(address, data, "write")

    def _pieces(self, address: int, nbytes: int, call: str) -> list[tuple[_Mapping, int, int]]:
        out = []
        pos, end = address, address + nbytes
        for m in self._overlapping(address, nbytes):
            if m.start > pos or not m.accessible:
                break
            take = min(end, m.start + m.size) - pos
            out.append((m, m.offset + pos - m.start, take))
            pos += take
            if pos >= end:
                break
        if pos < end:
            msg = f"device range {address:#x}+{nbytes} is not mapped and accessible (stops at {pos:#x})"
            raise DriverError(call, msg, 700)
        return out

    def _read(self, address: int, nbytes: int, call: str) -> bytes:
        return b"".join(bytes(m.handle.data[off : off + n]) for m, off, n in self._pieces(address, nbytes, call))

    def _write(self, address: int, data: bytes, call: str) -> None:
        pos = 0
        for m, off, n in self._pieces(address, len(data), call):
            m.handle.data[off : off + n] = data[pos : pos + n]
            pos += n

    def _overlapping(self, address: int, nbytes: int) -> list[_Mapping]:
        i = max(bisect.bisect_right(self._starts, address) - 1, 0)
        out = []
        while i < len(self._starts) and self._starts[i] < address + nbytes:
            m = self._mappings[self._starts[i]]
            if m.start + m.size > address:
                out.append(m)
            i += 1
        return out

    def _handle(self, handle: object, call: str) -> _Handle:
        if not isinstance(handle, _Handle):
            msg = f"{handle!r} is not a SimDriver handle"
            raise DriverError(call, msg, 1)
        return handle

    def _check_aligned(self, nbytes: int, call: str) -> None:
        if nbytes <= 0 or nbytes % self._granularity_bytes:
            msg = f"{nbytes} bytes is not a positive multiple of the granularity {self._granularity_bytes}"
            raise DriverError(call, msg, 1)
