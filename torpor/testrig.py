"""The simulated-device rig tests share: a ``SimDriver``, a ``TaggedAllocator`` on it, a ``SleepController`` over it.

:func:`sim_rig` builds a small simulated device (64 MiB of 64 KiB granules
unless told otherwise) and the real allocator on it, through the public
constructors (``SimDriver(...)``, ``TaggedAllocator(driver, ...)``); a rig's
:meth:`SimRig.control` puts a controller over the allocator. Nothing needs a
GPU or torch: the device's memory is host memory the native library maps.

Faults are injected at the driver, where a real device fails:

- ``rig.driver.fail(call, nth=1, times=1, oom=False)`` fails the ``nth`` next
  call of ``call`` (one of ``SimDriver.CALLS``: ``"map"``, ``"unmap"``,
  ``"create"``, ``"copy_d2h"``, ...) and the ``times - 1`` after it; the
  allocator raises what it raises on a real device (an ``AllocatorError`` naming
  the call, ``OutOfMemory`` with ``oom=True``); ``rig.driver.clear_faults()``
  disarms them.
- a fault no arming can say (a copy that stops half-way, pins that block) is a
  ``SimDriver`` subclass, passed built as ``sim_rig(driver=...)``.

:func:`fill` allocates under a tag and writes random bytes; :func:`intact` says
whether they are all still there (after a sleep and a wake, say).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from torpor.allocator import HostPolicy, SimDriver, TaggedAllocator
from torpor.statemachine import SleepController

#: The rig's granularity unless told otherwise: small, so a test's allocations stay small.
GRANULE = 64 * 1024

#: The rig's device capacity unless told otherwise.
CAPACITY = 64 << 20


@dataclass
class SimRig:
    """A simulated device (``driver``), the allocator on it, and the controller :meth:`control` made (or None)."""

    driver: SimDriver
    allocator: TaggedAllocator
    controller: SleepController | None = None

    def control(self, **options: Any) -> SleepController:
        """A ``SleepController`` over the allocator, kept as ``controller``; ``options`` are the controller's own (log, policy, engine, ...)."""
        self.controller = SleepController(self.allocator, **options)
        return self.controller

    def close(self) -> None:
        """Teardown: close the controller (when made), the allocator, and the handles a failed release left open."""
        if self.controller is not None:
            self.controller.close()
        self.allocator.close()
        self.driver.drop_handles()

    def __enter__(self) -> SimRig:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def sim_rig(
    capacity: int = CAPACITY,
    *,
    granularity: int = GRANULE,
    devices: int = 1,
    overhead: int = 0,
    host_capacity: int | None = None,
    reuse_host: bool = False,
    driver: SimDriver | None = None,
    host: HostPolicy | None = None,
    group_bytes: int | None = None,
    piece_bytes: int | None = None,
    slab_bytes: int | None = None,
) -> SimRig:
    """A ``SimDriver`` and a ``TaggedAllocator`` on it; no controller yet (:meth:`SimRig.control` makes one).

    The device: ``capacity`` bytes of ``granularity``-byte granules on
    ``devices`` devices, ``overhead`` bytes taken before any allocation (a CUDA
    context), ``host_capacity`` bytes of host memory to pin (None: the driver's default),
    ``reuse_host``: host ranges given back are handed out again, as ``mmap``
    after ``munmap`` may. ``driver``: a driver already built (a ``SimDriver``
    subclass that injects its own fault) instead of one from these.

    The allocator: ``host`` (its pinned-host policy), ``group_bytes``,
    ``piece_bytes``, ``slab_bytes`` as ``TaggedAllocator`` takes them; None
    leaves the allocator's own default.
    """
    if driver is None:
        driver = SimDriver(
            capacity,
            host_capacity=host_capacity,
            granularity=granularity,
            devices=devices,
            overhead=overhead,
            reuse_host=reuse_host,
        )
    sizes: dict[str, Any] = {"group_bytes": group_bytes, "piece_bytes": piece_bytes, "slab_bytes": slab_bytes}
    chosen = {name: n for name, n in sizes.items() if n is not None}
    return SimRig(driver, TaggedAllocator(driver, host=host, **chosen))


def fill(
    allocator: TaggedAllocator, tag: str, sizes: Iterable[int], *, rng: random.Random | None = None
) -> dict[int, bytes]:
    """Allocate each of ``sizes`` under ``tag`` and write random bytes over the whole allocation; address -> bytes.

    A size is rounded up to the granularity as the allocator does, and the
    bytes written cover that rounded size. ``rng``: the bytes drawn from it (a
    seeded ``random.Random`` repeats them), else ``os.urandom``.
    """
    out = {}
    for n in sizes:
        address = allocator.allocate(n, tag)
        whole = allocator.size_of(address)
        data = rng.randbytes(whole) if rng is not None else os.urandom(whole)
        allocator.write(address, data)
        out[address] = data
    return out


def intact(allocator: TaggedAllocator, data: Mapping[int, bytes]) -> bool:
    """Every allocation of ``data`` (address -> bytes, as :func:`fill` returns) still holds its bytes."""
    return all(allocator.read(address, len(expected)) == expected for address, expected in data.items())
