"""Text output of the CLI and the demo: seconds, rates, tables and the progress line (byte sizes: :func:`torpor.units.byte_size`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO


def fmt_seconds(seconds: float) -> str:
    """Seconds with a precision that suits their size."""
    if seconds < 0.001:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_rate(nbytes: int, seconds: float) -> str:
    """Bytes over seconds in GB/s (decimal, like link speeds); ``-`` when nothing moved."""
    if nbytes <= 0 or seconds <= 0:
        return "-"
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    """A plain-text table: left-aligned first column, right-aligned others."""
    cells = [list(headers), *[list(r) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


class Progress:
    """A progress line rewritten in place on a terminal; silent when the output is a file or a pipe."""

    def __init__(self, out: TextIO | None = None, total: int = 0) -> None:
        self.out = out or sys.stdout
        self.total = total
        self.done = 0
        self._tty = bool(getattr(self.out, "isatty", lambda: False)())
        self._width = 0
        self._start = time.perf_counter()

    def step(self, text: str) -> None:
        """Show ``text`` as the current step, with a bar of steps done so far."""
        bar = ""
        if self.total:
            filled = int(20 * min(self.done, self.total) / self.total)
            bar = f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} "
        msg = f"  {bar}{text}"
        if not self._tty:
            return
        pad = max(0, self._width - len(msg))
        self.out.write("\r" + msg + " " * pad)
        self._width = len(msg)
        self.out.flush()

    def advance(self) -> None:
        """Count one step as done."""
        self.done += 1

    def clear(self) -> None:
        """Remove the in-place line (terminal only) before printing something else."""
        if self._tty and self._width:
            self.out.write("\r" + " " * self._width + "\r")
            self.out.flush()
            self._width = 0
