"""The errors of torpor's integrations: graph capture, vLLM, the demo, the benchmarks and the CLI's files."""

from __future__ import annotations

from torpor.errors.base import TorporError

__all__ = [
    "ActivationError",
    "BenchError",
    "CaptureRoutingError",
    "DemoError",
    "NotWired",
    "OutputRefused",
]


class CaptureRoutingError(TorporError, RuntimeError):
    """A capture could not be routed (the pool is active but no controller was given)."""


class NotWired(TorporError, RuntimeError):
    """torpor was selected but vLLM in this process does not use torpor's allocator."""


class ActivationError(TorporError, RuntimeError):
    """torpor cannot take over vLLM's allocator in this process (vLLM's CuMemAllocator already holds memory)."""


class DemoError(TorporError, RuntimeError):
    """The demo cannot run here (a missing piece, or a device it cannot use)."""


class BenchError(TorporError, RuntimeError):
    """A benchmark step that could not be measured (a child process failed, a baseline driver call failed)."""


class OutputRefused(TorporError, ValueError):
    """A command's input or output file it cannot use (``-o`` a directory, a wrong suffix, not a regular file)."""
