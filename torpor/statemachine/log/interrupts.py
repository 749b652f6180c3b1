"""Steps an interrupt must not cut in two: Python signal handlers are held back around them and run right after.

CPython runs a Python-level signal handler in the main thread between two
instructions, so a Ctrl-C (``signal.default_int_handler`` raises
``KeyboardInterrupt``) or a SIGTERM handler that raises ``SystemExit`` (vLLM's)
can land on any instruction: after ``os.write`` put a line in the log but
before the writer counted it (the next event then repeats its sequence
number), between the log and the projection, between taking a lock and the
``try`` that releases it. Inside ``with UNINTERRUPTED:`` such a handler only
notes the signal; when the outermost block ends, the handlers that were
replaced are put back and called with what was noted, in arrival order, so the
interrupt is raised right after the step instead of in the middle of it.

What it does not change: handlers that are ``SIG_DFL`` or ``SIG_IGN`` (a
default SIGTERM still ends the process at once; the log's torn-line handling
covers a crash), threads other than the main one (no Python signal handler
runs there), and a system call already under way (an interrupted ``fsync``
or ``write`` is retried, as PEP 475 does whenever a handler returns). A block
costs two ``signal(2)`` system calls (about 1 µs, measured on a busy 2-core
machine; made through ``_signal``, the C module, as ``signal``'s wrappers
cost 3-4 µs more a call); a nested block costs nothing. Keep the blocks short:
a Ctrl-C waits for the end of one.
"""

from __future__ import annotations

import _signal  # the C functions behind ``signal``: its wrappers turn handlers into enums via an exception (~4 µs a call)
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

#: The signals whose Python handlers are held back (those that conventionally raise). SIGINT is always
#: swapped (one call that also returns its handler); SIGTERM only when it has a Python handler.
HELD_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class _Uninterrupted:
    """The context manager: reentrant, effective in the main thread, a no-op in any other."""

    __slots__ = ("_depth", "_pending", "_saved")

    def __init__(self) -> None:
        self._depth = 0
        self._saved: list[tuple[int, Any]] = []
        self._pending: list[tuple[int, FrameType | None]] = []

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._pending.append((signum, frame))

    def __enter__(self) -> None:
        if threading.get_ident() != threading.main_thread().ident:
            return
        self._depth += 1
        if self._depth > 1:
            return
        try:
            previous = _signal.signal(signal.SIGINT, self._note)  # one call: swapped, and what it was
            self._saved.append((signal.SIGINT, previous))
            if callable(_signal.getsignal(signal.SIGTERM)):  # rarely a Python handler (vLLM's): swapped only then
                self._saved.append((signal.SIGTERM, _signal.signal(signal.SIGTERM, self._note)))
        except BaseException:  # a signal that came before its handler was replaced: nothing begun, put all back
            self._restore()
            raise

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if threading.get_ident() != threading.main_thread().ident:
            return
        self._depth -= 1
        if not self._depth:
            self._restore()

    def _restore(self) -> None:
        """Put the replaced handlers back (one installed meanwhile by someone else stays), then run what was noted."""
        self._depth = 0
        saved, self._saved = self._saved, []
        self._put_back(saved)
        pending, self._pending = self._pending, []
        handlers = dict(saved)
        for signum, frame in pending:  # the first that raises wins (a second Ctrl-C is the same Ctrl-C)
            handler = handlers.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler == _signal.SIG_DFL:  # what it would have done: end the process (or whatever the default is)
                _signal.raise_signal(signum)

    def _put_back(self, saved: list[tuple[int, Any]]) -> None:
        """Restore each handler; a signal that a handler already put back raises for cannot leave another one ours."""
        if not saved:
            return
        (sig, handler), rest = saved[0], saved[1:]
        try:
            self._put_back(rest)
        finally:
            current = _signal.signal(sig, handler)
            if current != self._note:  # replaced inside the block: theirs wins
                _signal.signal(sig, current)

    @property
    def active(self) -> bool:
        """True inside a block in the main thread."""
        return self._depth > 0


#: ``with UNINTERRUPTED:`` holds back SIGINT and SIGTERM handlers until the block ends.
UNINTERRUPTED = _Uninterrupted()

__all__ = ["HELD_SIGNALS", "UNINTERRUPTED"]
