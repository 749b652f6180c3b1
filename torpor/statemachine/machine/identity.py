"""The controller's core: construction, the event recorder and the reading API.

Every command module (:mod:`~torpor.statemachine.machine.sleeping`,
:mod:`~torpor.statemachine.machine.waking`, ...) builds on :class:`ControllerBase`;
:class:`~torpor.statemachine.machine.controller.SleepController` joins them. This
module is where events are made, written, folded into the projection and handed
to subscribers (:meth:`ControllerBase._emit`). The state is the projection's and
nothing else holds a copy: the gate asks the transition table
(:func:`torpor.statemachine.core.states.decide`) whether a command may run, and the
events move the state along the table's edges.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from torpor.errors import ControllerClosed, TorporError
from torpor.statemachine.core.events import Event, EventKind, make_event
from torpor.statemachine.core.policy import DEFAULT_POLICY, Policy
from torpor.statemachine.core.protocol import Memory
from torpor.statemachine.core.states import State
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.log.fanout import Fanout
from torpor.statemachine.log.interrupts import UNINTERRUPTED
from torpor.statemachine.log.reader import read_current
from torpor.statemachine.machine.group import DEFAULT_TIMEOUT, GroupMember, as_agreement
from torpor.statemachine.machine.hostmem import apply_host_policy
from torpor.statemachine.projection.view import Projection, project

logger = logging.getLogger("torpor")

Subscriber = Callable[[Event], None]
GiB = 1024**3


def _clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters in all)"


def _tag_list(tags: Sequence[str] | str) -> list[str]:
    """Tags as a list without repeats; one tag may be given as a plain string."""
    return list(dict.fromkeys([tags] if isinstance(tags, str) else tags))


def _names_a_directory(path: Path, given: str) -> bool:
    """Whether a ``log`` path names a directory: existing, ending in a separator, or new and without a suffix."""
    if path.is_dir() or given.endswith(("/", "\\")):
        return True
    return not path.exists() and not path.suffix


#: The longest engine name: its log file ``.ENGINE.rankN.jsonl.lock`` must fit a 255-byte file name.
MAX_ENGINE_NAME = 200
#: The largest rank a log can record (a JSON integer every reader takes: 2**63-1).
MAX_RANK = 2**63 - 1


def check_identity(engine: object, rank: object, *, names_file: bool) -> None:
    """Refuse a rank that is no integer 0..2**63-1 and, when it names the log file, an engine name that is no plain file name.

    With a log directory the engine and rank name the file
    (``ENGINE.rankN.jsonl``) inside it, so ``"../escaped"`` would write
    outside it and ``"."`` or ``""`` name no file of its own; ``rank=-1`` or
    ``"0"`` were refused only when the first event was written, after the
    files were created. Checked before anything is made. (A name that names
    no file, with ``log=None`` or a log file given, may hold any character: it
    is a label.)
    """
    if type(engine) is not str:
        msg = f"engine must be a str naming the engine, got {type(engine).__name__} {engine!r}; nothing was created"
        raise TypeError(msg)
    if type(rank) is not int:  # not True, not "0", not 0.0
        msg = f"rank must be an int, got {type(rank).__name__} {rank!r}; nothing was created"
        raise TypeError(msg)
    if not 0 <= rank <= MAX_RANK:
        msg = f"rank {rank} is refused: a rank is 0..2**63-1 (rank 0 is the first); nothing was created"
        raise ValueError(msg)
    if not names_file:
        return
    problem = ""
    if not engine or engine in (".", ".."):
        problem = "it names no file of its own"
    elif "/" in engine or "\\" in engine:
        problem = "it holds a path separator, so its log would be written outside the log directory"
    elif engine.startswith("."):
        problem = "it starts with '.', which the log's hidden lock and rotation files use"
    elif not engine.isprintable():
        problem = "it holds a control character"
    elif len(engine.encode("utf-8", "surrogatepass")) > MAX_ENGINE_NAME:
        problem = f"it is longer than {MAX_ENGINE_NAME} bytes"
    if problem:
        msg = (
            f"engine name {_clip(repr(engine), 80)} is refused: {problem}; it names the log file ENGINE.rankN.jsonl, "
            "so give a plain file name such as 'llm0'; nothing was created"
        )
        raise ValueError(msg)


def log_path_for(directory: str | Path, engine: str, rank: int) -> Path:
    """The file of ``engine``'s rank ``rank`` inside a shared log directory."""
    return Path(directory) / f"{engine}.rank{rank}.jsonl"


class ControllerBase:
    """One engine rank's controller without its commands: the events, the projection, the reading API.

    See :class:`~torpor.statemachine.machine.controller.SleepController` for the
    arguments; the command modules add the commands, and no state: every attribute
    of a controller is set here (docs/architecture.md, "The controller's state",
    says what each is and who changes it; tests/test_architecture.py checks it).
    """

    def __init__(
        self,
        memory: Memory,
        log: EventLog | str | Path | None = None,
        policy: Policy | None = None,
        engine: str = "default",
        rank: int = 0,
        *,
        fsync: bool = True,
        keep_events: int = 10_000,
        group: object | None = None,
        group_timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        names_file = isinstance(log, str | Path) and _names_a_directory(Path(log), str(log))
        check_identity(engine, rank, names_file=names_file)  # before anything is made: a file, the host policy
        self.memory = memory
        self.policy = policy or DEFAULT_POLICY
        self.host_policy = self.policy.host_policy()
        apply_host_policy(memory, self.host_policy, self.policy.never_backed_up())
        self.engine = engine
        self.rank = rank
        self.group = None if group is None else GroupMember(as_agreement(group), group_timeout)
        if isinstance(log, str | Path):
            path = Path(log)
            if _names_a_directory(path, str(log)):
                path = log_path_for(path, engine, rank)
            log = EventLog(path, fsync=fsync)
        self.log: EventLog | None = log
        self._command_lock = threading.Lock()
        self._in_flight = ""
        self._owner: int | None = None  # the thread running the command in flight
        self._closed_at = 0  # the sequence number of the ``closed`` event, once closed
        self._log_failure = ""  # why a rollback could not be recorded (the controller then needs recover())
        self._emit_lock = threading.RLock()
        self._changed = threading.Condition(self._emit_lock)
        self._subscribers: Fanout[Subscriber] = Fanout(logger, "torpor subscriber")
        self._recent: list[Event] = []
        self._keep_events = keep_events
        self.projection = Projection(engine=engine, rank=rank)
        self._seq = 0
        if self.log is not None and self.log.last_seq:  # from the newest snapshot: a restart costs one file's read
            self.projection = project(read_current(self.log.path, self.log.max_line))
            self._seq = self.log.last_seq
        if not self.projection.interrupted:
            self._emit(
                EventKind.OPENED,
                usage=self._resident_usage(),
                allocations=self._allocation_counts(),
                memory=type(memory).__name__,
                previous_state=self.projection.state.value if self._seq else None,
                host=self.host_policy.to_dict(),
            )

    # -- reading --------------------------------------------------------------

    @property
    def state(self) -> State:
        """The current state (a projection of the events)."""
        return self.projection.state

    @property
    def last_seq(self) -> int:
        """Sequence number of the last event recorded."""
        return self._seq

    def events(self, after: int = 0) -> list[Event]:
        """Recent events (up to ``keep_events``) with a sequence number above ``after``."""
        with self._emit_lock:
            return [e for e in self._recent if e.seq > after]

    def subscribe(self, callback: Subscriber, kinds: Iterable[EventKind | str] | None = None) -> Callable[[], None]:
        """Call ``callback(event)`` after each event (of ``kinds``); return an unsubscribe function."""
        with self._emit_lock:  # not while an event is being delivered
            remove = self._subscribers.subscribe(callback, kinds)

        def unsubscribe() -> None:
            with self._emit_lock:
                remove()

        return unsubscribe

    def wait_for(self, state: State | str, timeout: float | None = None) -> bool:
        """Block until the controller is in ``state``; False on timeout."""
        target = State(state)
        with self._changed:
            return self._changed.wait_for(lambda: self.projection.state is target, timeout)

    async def wait_for_async(self, state: State | str, timeout: float | None = None) -> bool:
        """Asyncio variant of :meth:`wait_for`; never blocks the event loop."""
        target = State(state)
        loop = asyncio.get_running_loop()
        reached: asyncio.Future[bool] = loop.create_future()

        def on_event(_: Event) -> None:
            if self.projection.state is target:
                loop.call_soon_threadsafe(lambda: None if reached.done() else reached.set_result(True))

        unsubscribe = self.subscribe(on_event)
        try:
            if self.projection.state is target:
                return True
            try:
                return await asyncio.wait_for(reached, timeout)
            except TimeoutError:
                return False
        finally:
            unsubscribe()

    def _resident_usage(self) -> dict[str, int]:
        return {tag: u.resident for tag, u in self.memory.usage().items()}

    def _allocation_counts(self) -> dict[str, int]:
        return {tag: u.allocations for tag, u in self.memory.usage().items()}

    def _emit(self, kind: EventKind, **data: Any) -> Event:
        with UNINTERRUPTED, self._emit_lock:  # log, projection, subscribers: a Ctrl-C is raised after, never between
            if self._closed_at:
                raise ControllerClosed(f"record {kind.value}", self.engine, self.rank, self._closed_at)
            event = make_event(kind, self._seq + 1, self.engine, self.rank, data)
            if self.log is not None:
                self.log.append(event)
            self._seq = event.seq
            self.projection.apply(event)
            delivered = [event]
            if self.log is not None and kind is not EventKind.SNAPSHOT and self.log.needs_rotation():
                snap = make_event(
                    EventKind.SNAPSHOT, self._seq + 1, self.engine, self.rank, {"projection": self.projection.to_dict()}
                )
                try:
                    self.log.rotate(snap)
                except (OSError, TorporError):  # the active file keeps growing; the next try is max_bytes later
                    logger.exception("torpor: rotating %s failed; appending to the active file", self.log.path)
                else:
                    self._seq = snap.seq
                    self.projection.apply(snap)
                    delivered.append(snap)  # subscribers and events() see every sequence number, as the log does
            self._recent.extend(delivered)
            if len(self._recent) > self._keep_events:
                del self._recent[: len(self._recent) - self._keep_events]
            self._changed.notify_all()
            for sent in delivered:
                self._subscribers.publish(sent)  # a subscriber that raises is logged; it never breaks the controller
            return event
