"""Where host backup memory comes from: a provider the arena may be given (a keeper process's shared memory).

Why: a backup in the engine's own anonymous pages dies with the engine. A
provider puts memory another process owns (``torpor.keeper``: memfd regions of
a keeper process) under the ranges the arena reserves, so the copies a sleep
makes land there directly, with no extra copy. What does not change: the arena
reserves, pins (``host_alloc``: faulted in and registered) and frees its ranges
through the driver as before; a provider only backs a freshly reserved, never
written range (MAP_FIXED over it) and hears when the driver gave it back.
Mechanism only: whether to use a provider is the caller's choice
(:meth:`~torpor.allocator.host.pinning.PinnedChunks.use_provider`).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["HostProvider"]


class HostProvider(Protocol):
    """Host memory for backup ranges; never raises from either call (a failure keeps the driver's own memory)."""

    def back(self, host: int, nbytes: int) -> bool:
        """Put the provider's memory under the reserved range ``[host, host + nbytes)``; False: left as it was."""
        ...

    def forget(self, host: int, nbytes: int) -> None:
        """The driver gave ``[host, host + nbytes)`` back (unpinned and unmapped, or unreserved); drop what backs it."""
        ...
