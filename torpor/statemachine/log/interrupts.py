"""Steps an interrupt must not cut in two: Python signal handlers are held back around them and run right after.

CPython runs a Python-level signal handler in the main thread between two
instructions, so a Ctrl-C (``signal.default_int_handler`` raises
``KeyboardInterrupt``), a SIGTERM handler that raises ``SystemExit`` (vLLM's),
a step watchdog's SIGALRM handler (``signal.setitimer``, as timeout helpers
do) or any other handler that raises (SIGUSR1, SIGHUP, ...) can land on any
instruction: after ``os.write`` put a line in the log but before the writer
counted it (the next event then repeats its sequence number), between the log
and the projection (every later event is then refused as out of sequence),
between taking a lock and the ``try`` that releases it. Inside
``with UNINTERRUPTED:`` every Python handler only notes its signal; when the
outermost block ends, the handlers that were replaced are put back and called
with what was noted, in arrival order (a signal noted several times is called
once, as the kernel delivers a pending signal once), so whatever a handler
raises is raised right after the step instead of in the middle of it.

What it does not change: handlers that are ``SIG_DFL`` or ``SIG_IGN`` (a
default SIGTERM still ends the process at once; the log's torn-line handling
covers a crash), threads other than the main one (no Python signal handler
runs there), and a system call already under way (an interrupted ``fsync``
or ``write`` is retried, as PEP 475 does whenever a handler returns). A block
costs two ``signal(2)`` system calls per signal that has a Python handler
(SIGINT alone, usually: about 1 µs, measured on a busy 2-core machine; made
through ``_signal``, the C module, as ``signal``'s wrappers cost 3-4 µs more a
call) and a look at every other signal's handler (no system call, picked in C:
about 3 µs more a block on that machine, 1.6 µs a block before, when only
SIGINT and SIGTERM were looked at; a sleep and a wake of the simulated device
went from 0.35 to 0.41 ms); a nested block costs nothing. Keep the blocks short: a signal's handler
waits for the end of one.
"""

from __future__ import annotations

import _signal  # the C functions behind ``signal``: its wrappers turn handlers into enums via an exception (~4 µs a call)
import signal
import threading
from itertools import compress
from types import FrameType, TracebackType
from typing import Any

#: The signals whose Python handlers are held back: every one a handler can be set for. SIGINT is always
#: swapped; any other only when it has a Python handler.
HELD_SIGNALS: tuple[int, ...] = tuple(
    sorted(int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))
)
_SIGINT_AT = HELD_SIGNALS.index(signal.SIGINT)


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
            # No system call, no Python loop over every signal: read from the interpreter's table and pick
            # in C. SIGINT always (its default is emulated when noted); any other only with a Python handler
            # (vLLM's SIGTERM, a watchdog's SIGALRM).
            handlers = list(map(_signal.getsignal, HELD_SIGNALS))
            swapped = list(map(callable, handlers))
            swapped[_SIGINT_AT] = True
            for signum, handler in compress(zip(HELD_SIGNALS, handlers, strict=True), swapped):
                self._saved.append((signum, handler))  # noted before it is swapped: a handler raising between
                _signal.signal(signum, self._note)  # the two calls leaves nothing of ours installed
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
        try:
            self._put_back(saved)
        except BaseException:  # a handler put back already raised (a signal in between): it is the first to raise
            self._pending = []
            raise
        pending, self._pending = self._pending, []
        handlers = dict(saved)
        called: set[int] = set()
        for signum, frame in pending:  # the first that raises wins (a second Ctrl-C is the same Ctrl-C)
            if signum in called:  # pending once, as the kernel keeps a signal (a repeating timer's ticks are one)
                continue
            called.add(signum)
            handler = handlers.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler == _signal.SIG_DFL:  # what it would have done: end the process (or whatever the default is)
                _signal.raise_signal(signum)

    def _put_back(self, saved: list[tuple[int, Any]]) -> None:
        """Restore each handler still ours, all of them even when one put back raises; then raise the first that did.

        ``signal.signal`` runs the handlers of signals that arrived before it
        changes anything, and changes nothing when one raises; and a handler
        put back may run at the next instruction. So the whole loop is one
        ``try`` that is gone through again until every handler is put back,
        each looked up first (``getsignal`` runs no handler): one still ours is
        put back, one installed inside the block by someone else stays.
        """
        raised: BaseException | None = None
        while True:
            try:
                for sig, handler in saved:
                    if _signal.getsignal(sig) == self._note:
                        _signal.signal(sig, handler)
                break
            except BaseException as exc:
                raised = raised or exc
        if raised is not None:
            raise raised

    @property
    def active(self) -> bool:
        """True inside a block in the main thread."""
        return self._depth > 0


#: ``with UNINTERRUPTED:`` holds back every Python signal handler until the block ends.
UNINTERRUPTED = _Uninterrupted()

__all__ = ["HELD_SIGNALS", "UNINTERRUPTED"]
