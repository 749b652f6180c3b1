"""The raw path: allocations made and freed by address, outside torch's pools, and device bytes written through the driver.

:class:`RawPath` is a part :class:`~torpor.allocator.TaggedAllocator` owns; its
``allocate``, ``free``, ``size_of`` and ``write`` are these. torch's own malloc and free
do not come here: they are the native library's C functions.
"""

from __future__ import annotations

from collections.abc import Callable

from torpor.allocator.host.offload import HostArena
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.cycle import SleepWake
from torpor.allocator.sleepwake.tagbook import TagBook
from torpor.errors import AllocatorError, DriverError, TagNotAwake
from torpor.statemachine.core.policy import DEFAULT_TAG

__all__ = ["RawPath"]


class RawPath:
    """Allocate, free and write by address over the allocator's table, book, cycle and driver.

    ``host``: the arena whose policy says which tags pin ahead; ``grow_host``: raise the
    pin-ahead target to the tagged bytes (after an allocation of such a tag).
    """

    def __init__(
        self,
        *,
        driver: Driver,
        table: NativeTable,
        book: TagBook,
        cycle: SleepWake,
        host: HostArena,
        grow_host: Callable[[], None],
    ) -> None:
        self._driver = driver
        self._table = table
        self._book = book
        self._cycle = cycle
        self._host = host
        self._grow_host = grow_host

    def allocate(self, nbytes: int, tag: str | None, device: int) -> int:
        """Map ``nbytes`` under ``tag`` (None: this thread's tag, else the default one) on ``device``; the address."""
        tag = (self._book.current() or DEFAULT_TAG) if tag is None else tag  # "" is refused, not the default
        if nbytes <= 0:
            msg = f"cannot allocate {nbytes} bytes"
            raise AllocatorError("allocate", tag, msg)
        self._book.state(tag)
        try:
            address = self._table.alloc(tag, device, nbytes)
        except AllocatorError as exc:
            asleep = self._book.not_awake(tag)
            if asleep is None:
                raise
            raise TagNotAwake(tag, *asleep, operation="allocate", detail=f"{nbytes} bytes") from exc
        if tag not in self._host.policy.prepin_exclude:
            self._grow_host()
        return address

    def free(self, address: int) -> None:
        """Free the allocation at ``address`` and forget its host backup, if any."""
        self._table.free(address)
        with self._book.lock:
            for record in self._book.records.values():
                if record.pieces:
                    self._cycle.forget(record, {address})

    def size_of(self, address: int) -> int:
        """Mapped size of the allocation at ``address``."""
        for a, n, _ in self._table.allocations():
            if a == address:
                return n
        msg = f"{address:#x} is not an allocation of this allocator"
        raise AllocatorError("size_of", None, msg)

    def write(self, address: int, data: bytes) -> None:
        """Write ``data`` at ``address``; at a tag asleep or going to sleep, :class:`~torpor.errors.TagNotAwake`."""
        try:
            self._driver.write(address, data)
        except DriverError as exc:
            tag = self._book.owner(address)
            asleep = self._book.not_awake(tag) if tag is not None else None
            if tag is None or asleep is None:
                raise
            raise TagNotAwake(tag, *asleep, operation="write", detail=f"{len(data)} bytes at {address:#x}") from exc
