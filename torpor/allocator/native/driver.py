"""The driver interface under the allocator: the few VMM, host-memory and copy calls it makes.

Two implementations: :class:`~torpor.allocator.native.cuda_driver.CudaDriver` (the CUDA
driver through ``cuda-bindings``) and :class:`~torpor.allocator.native.sim.SimDriver`
(host memory with fault injection, for machines without a GPU). Every call goes
through one choke point, :meth:`Driver.invoke`, so a simulated driver can record
and fail any of them; the names of all calls are in :attr:`Driver.CALLS`.
Addresses, host pointers, streams and events are plain Python objects the driver
hands out; the allocator never looks inside them.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from torpor.allocator.native.headroom import host_headroom


class Driver(ABC):
    """Mechanism the :class:`~torpor.allocator.TaggedAllocator` drives; one instance per process."""

    CALLS: ClassVar[tuple[str, ...]] = (
        "granularity",
        "reserve",
        "unreserve",
        "create",
        "map",
        "set_access",
        "unmap",
        "release",
        "host_reserve",
        "host_alloc",
        "host_free",
        "host_unreserve",
        "copy_d2h",
        "copy_h2d",
        "record",
        "wait",
        "synchronize",
        "mem_info",
        "host_copy",
        "host_register",
    )
    """Every driver call by name, in the order a sleep/wake cycle meets them."""

    name: ClassVar[str] = "driver"

    def invoke(self, call: str, *args: Any) -> Any:
        """The one choke point: run driver call ``call`` (a name in :attr:`CALLS`) with ``args``."""
        return getattr(self, "_" + call)(*args)

    # -- the public calls (each goes through invoke) ------------------------------

    def granularity(self, device: int) -> int:
        """Mapping granularity in bytes on ``device`` (sizes and addresses are multiples of it)."""
        return int(self.invoke("granularity", device))

    def reserve(self, nbytes: int, device: int) -> int:
        """Reserve ``nbytes`` of virtual address space; return its start."""
        return int(self.invoke("reserve", nbytes, device))

    def unreserve(self, address: int, nbytes: int) -> None:
        """Free an address reservation made by :meth:`reserve`."""
        self.invoke("unreserve", address, nbytes)

    def create(self, nbytes: int, device: int) -> object:
        """Create ``nbytes`` of physical memory on ``device``; return its handle."""
        return self.invoke("create", nbytes, device)

    def map(self, address: int, nbytes: int, handle: object) -> None:
        """Map a whole physical handle at ``address`` (inside a reservation; CUDA maps no sub-range of a handle)."""
        self.invoke("map", address, nbytes, handle)

    def set_access(self, address: int, nbytes: int, device: int) -> None:
        """Make a mapped range readable and writable from ``device``."""
        self.invoke("set_access", address, nbytes, device)

    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap a range mapped by :meth:`map` (the handle stays alive)."""
        self.invoke("unmap", address, nbytes)

    def release(self, handle: object) -> None:
        """Release a physical handle (its memory goes once it is unmapped everywhere)."""
        self.invoke("release", handle)

    def host_reserve(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of host address space (nothing faulted in or pinned); return its start.

        Pieces of it are pinned one by one with ``host_alloc(n, host=...)``; a
        piece never pinned goes back with :meth:`host_unreserve`.
        """
        return int(self.invoke("host_reserve", nbytes))

    def host_alloc(self, nbytes: int, host: int | None = None) -> int:
        """Pin ``nbytes`` of host memory (fresh, or the reserved range at ``host``); return its address.

        The pages are faulted in by this call and may be written (zeros): never
        for memory that holds data (that is :meth:`host_register`). A failure
        pins nothing; a reserved range given stays reserved (give it back with
        :meth:`host_unreserve`).
        """
        return int(self.invoke("host_alloc", nbytes, host))

    def host_free(self, host: int) -> None:
        """Unpin and unmap host memory from :meth:`host_alloc`."""
        self.invoke("host_free", host)

    def host_unreserve(self, host: int, nbytes: int) -> None:
        """Give back reserved host address space that was never pinned."""
        self.invoke("host_unreserve", host, nbytes)

    def copy_d2h(self, host: int, address: int, nbytes: int, device: int) -> None:
        """Enqueue a copy of ``nbytes`` from device ``address`` to ``host`` on ``device``'s copy stream."""
        self.invoke("copy_d2h", host, address, nbytes, device)

    def copy_h2d(self, address: int, host: int, nbytes: int, device: int) -> None:
        """Enqueue a copy of ``nbytes`` from ``host`` to device ``address`` on ``device``'s copy stream."""
        self.invoke("copy_h2d", address, host, nbytes, device)

    def record(self, device: int) -> object:
        """Record an event after the copies enqueued so far on ``device``'s copy stream."""
        return self.invoke("record", device)

    def wait(self, event: object) -> None:
        """Block until ``event`` completed (raises the copy's error if one failed)."""
        self.invoke("wait", event)

    def synchronize(self, device: int) -> None:
        """Block until all work on ``device`` (every stream) is done."""
        self.invoke("synchronize", device)

    def mem_info(self, device: int) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        free, total = self.invoke("mem_info", device)
        return int(free), int(total)

    def host_register(self, host: int, nbytes: int) -> None:
        """Pin reserved host memory that already holds data (never written here); freed with :meth:`host_free`."""
        self.invoke("host_register", host, nbytes)

    def host_copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` of host memory from pinned ``src`` to reserved ``dst`` (pinned or not); any thread."""
        self.invoke("host_copy", dst, src, nbytes)

    # -- what implementations provide -----------------------------------------------

    @abstractmethod
    def _granularity(self, device: int) -> int: ...

    @abstractmethod
    def _reserve(self, nbytes: int, device: int) -> int: ...

    @abstractmethod
    def _unreserve(self, address: int, nbytes: int) -> None: ...

    @abstractmethod
    def _create(self, nbytes: int, device: int) -> object: ...

    @abstractmethod
    def _map(self, address: int, nbytes: int, handle: object) -> None: ...

    @abstractmethod
    def _set_access(self, address: int, nbytes: int, device: int) -> None: ...

    @abstractmethod
    def _unmap(self, address: int, nbytes: int) -> None: ...

    @abstractmethod
    def _release(self, handle: object) -> None: ...

    @abstractmethod
    def _host_reserve(self, nbytes: int) -> int: ...

    @abstractmethod
    def _host_alloc(self, nbytes: int, host: int | None) -> int: ...

    @abstractmethod
    def _host_free(self, host: int) -> None: ...

    @abstractmethod
    def _host_unreserve(self, host: int, nbytes: int) -> None: ...

    @abstractmethod
    def _copy_d2h(self, host: int, address: int, nbytes: int, device: int) -> None: ...

    @abstractmethod
    def _copy_h2d(self, address: int, host: int, nbytes: int, device: int) -> None: ...

    @abstractmethod
    def _record(self, device: int) -> object: ...

    @abstractmethod
    def _wait(self, event: object) -> None: ...

    @abstractmethod
    def _synchronize(self, device: int) -> None: ...

    @abstractmethod
    def _mem_info(self, device: int) -> tuple[int, int]: ...

    @abstractmethod
    def _host_register(self, host: int, nbytes: int) -> None: ...

    def _host_copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)  # ctypes lets go of the GIL: threads copy at once

    # -- optional -----------------------------------------------------------------

    def ensure_context(self, device: int) -> None:
        """Make a context for ``device`` current in this thread when none is (no-op off CUDA)."""
        return None

    def prepare_device(self, device: int) -> None:
        """Make what sleeps on ``device`` will use (context, copy stream) now, while awake (no-op off CUDA)."""
        return None

    def host_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more host pages can be faulted in by writing with room to spare (then counted as taken).

        Not a driver call: the host's MemAvailable and cgroup limits
        (:mod:`torpor.allocator.native.headroom`); a write fault with no room calls the
        OOM killer, where pinning fails with a clear error.
        """
        return host_headroom.claim(nbytes)

    def prepare_thread(self) -> None:
        """Set up a helper thread (pinning): a context, and no interference with graph captures elsewhere."""
        return None

    def read(self, address: int, nbytes: int) -> bytes:
        """Read device bytes (tests, demos); drivers without cheap access may refuse."""
        msg = f"{type(self).__name__} cannot read device memory directly"
        raise NotImplementedError(msg)

    def write(self, address: int, data: bytes) -> None:
        """Write device bytes (tests, demos); drivers without cheap access may refuse."""
        msg = f"{type(self).__name__} cannot write device memory directly"
        raise NotImplementedError(msg)
