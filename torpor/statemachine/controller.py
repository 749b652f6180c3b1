"""The SleepController: guards every memory command, plans it, drives the memory, records events.

The flow has one direction: a command is guarded by the state machine (built
with ``transitions`` from the table in :mod:`torpor.statemachine.states`),
planned by the policy, executed by the memory object (mechanism only), and
recorded as events; the state and per-tag residency are a projection of those
events, the same one :func:`torpor.statemachine.replay` computes from the log.
Subscribers (telemetry, RL feeds) are called after each event and can never
break the controller. Commands are serialized: one arriving while another is in
flight is refused (``CommandInFlight``), never queued behind a lock.

Anything raised inside a sleep or a wake (a memory error, a ``KeyboardInterrupt``,
a log that cannot be written) rolls the command back, then is raised again. When
the rollback itself cannot be recorded the controller stays in the transitional
state and refuses with ``NotRecovered`` until :meth:`SleepController.recover`,
which takes each tag's residency from the memory as it is.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from transitions import Machine

from torpor.errors import (
    CommandInFlight,
    ControllerClosed,
    InvalidLevel,
    InvalidTransition,
    LogWriteFailed,
    MemoryOperationFailed,
    NotRecovered,
    PoolBusy,
    TorporError,
    UnknownTag,
)
from torpor.statemachine.events import Event, EventKind, make_event
from torpor.statemachine.group import DEFAULT_TIMEOUT, GroupMember, as_agreement, collective, undo_discard
from torpor.statemachine.hostmem import (
    apply_host_policy,
    backup_bytes,
    budget_refusal,
    device_report,
    release_unused_host,
)
from torpor.statemachine.log import EventLog, read_events
from torpor.statemachine.policy import DEFAULT_POLICY, Action, Policy
from torpor.statemachine.projection import Projection, project
from torpor.statemachine.protocol import GraphPoolMemory, Memory, Transfer
from torpor.statemachine.states import ASLEEP, TRANSITIONS, State, allowed_sources

logger = logging.getLogger("torpor")

Subscriber = Callable[[Event], None]
GiB = 1024**3


class _Model:
    """The ``transitions`` model: holds the machine state and the guard predicates."""

    state: str

    def __init__(self, owner: SleepController) -> None:
        self._owner = owner

    def level_is_1(self) -> bool:
        return self._owner.projection.level == 1

    def level_is_2(self) -> bool:
        return self._owner.projection.level == 2

    def came_from_awake(self) -> bool:
        return self._owner.projection.resume_from is State.AWAKE

    def came_from_partial(self) -> bool:
        return self._owner.projection.resume_from is State.PARTIALLY_AWAKE

    def came_from_l1(self) -> bool:
        return self._owner.projection.resume_from is State.ASLEEP_L1

    def came_from_l2(self) -> bool:
        return self._owner.projection.resume_from is State.ASLEEP_L2

    def all_resident(self) -> bool:
        return not self._owner.projection.asleep_tags()


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


def log_path_for(directory: str | Path, engine: str, rank: int) -> Path:
    """The file of ``engine``'s rank ``rank`` inside a shared log directory."""
    return Path(directory) / f"{engine}.rank{rank}.jsonl"


class SleepController:
    """Guards, plans and records every memory command of one engine rank.

    ``memory`` meets :class:`~torpor.statemachine.protocol.Memory`; ``log`` is
    an :class:`EventLog`, a file path (an existing file, or a new path with a
    suffix such as ``.jsonl``), a directory (an existing one, a path ending in
    ``/``, or a new path without a suffix; the file is ``ENGINE.rankN.jsonl``
    inside it) or None (events kept in memory only).

    ``group`` (a ``torch.distributed`` process group of any backend, whose
    rendezvous store carries the votes, or any
    :class:`~torpor.statemachine.group.Agreement`) makes ``sleep``, ``wake``
    and ``discard`` collective: they complete only when every rank succeeded,
    else every rank rolls back and raises ``GroupFailed``; a rank silent for
    ``group_timeout`` seconds counts as failed (docs/groups.md).
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
        self.memory = memory
        self.policy = policy or DEFAULT_POLICY
        self.host_policy = self.policy.host_policy()
        apply_host_policy(memory, self.host_policy)
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
        self._subscribers: list[tuple[Subscriber, frozenset[EventKind] | None]] = []
        self._recent: list[Event] = []
        self._keep_events = keep_events
        self.projection = Projection(engine=engine, rank=rank)
        self._seq = 0
        if self.log is not None and self.log.last_seq:
            self.projection = project(read_events(self.log.path))
            self._seq = self.log.last_seq
        self._model = _Model(self)
        self._machine = Machine(
            model=self._model,
            states=[s.value for s in State],
            transitions=TRANSITIONS,
            initial=self.projection.state.value,
            auto_transitions=False,
        )
        if not self.projection.interrupted:
            self._emit(
                EventKind.OPENED,
                usage=self._resident_usage(),
                memory=type(memory).__name__,
                previous_state=self.projection.state.value if self._seq else None,
                host=self.host_policy.to_dict(),
            )
            self._sync_machine()

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
        wanted = None if kinds is None else frozenset(EventKind(k) for k in kinds)
        entry = (callback, wanted)
        with self._emit_lock:
            self._subscribers.append(entry)

        def unsubscribe() -> None:
            with self._emit_lock:
                if entry in self._subscribers:
                    self._subscribers.remove(entry)

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

    # -- commands -------------------------------------------------------------

    @collective("sleep")
    def sleep(self, level: int = 1, *, idempotent: bool = False) -> Projection:
        """Put the engine to sleep at ``level`` (1 or 2); return the resulting projection.

        ``idempotent``: a sleep while already asleep at ``level`` or deeper is a
        no-op recorded as ``command_repeated`` instead of a refusal (what an
        orchestrator that retries on every rank needs; the vLLM backend sets it).
        """
        with self._command("sleep", level=level):
            if type(level) is not int or level not in (1, 2):  # not True, not 1.0
                self._refuse("sleep", InvalidLevel(level))
            if idempotent and self.state in ASLEEP and (self.projection.level or 0) >= level:
                why = f"already asleep at level {self.projection.level} since event #{self.projection.since}"
                return self._repeated("sleep", {"level": level}, why)
            self._guard("sleep")
            return self._sleep(level)

    @collective("wake")
    def wake(self, tags: Sequence[str] | str | None = None, *, idempotent: bool = False) -> Projection:
        """Wake ``tags`` (None: all); every non-deferrable tag is restored by any wake.

        ``idempotent``: a wake that would restore nothing (every tag asked for,
        and every tag any wake restores, is resident) is a no-op recorded as
        ``command_repeated`` instead of a refusal; unknown tags are still refused.
        """
        with self._command("wake", tags=tags):
            wanted = None if tags is None else _tag_list(tags)
            if idempotent and self.state in (State.AWAKE, State.PARTIALLY_AWAKE):
                if wanted is not None:
                    self._check_tags("wake", wanted)
                if not self.policy.wake_set(wanted, self.projection.asleep_tags()):
                    return self._repeated("wake", {"tags": wanted}, f"every tag asked for is resident ({self.state})")
            self._guard("wake")
            return self._wake(wanted)

    @collective("discard")
    def discard(self, tags: Sequence[str] | str) -> Projection:
        """Discard ``tags``; the next wake that restores them maps fresh memory.

        An asleep tag loses its host backup. A resident deferrable tag (``weights``,
        ``kv_cache``) is released without a backup, as vLLM's
        ``release_kv_cache_memory()`` asks, and an awake engine becomes
        ``partially_awake``. ``cudagraph`` is never discarded, and a resident tag
        that every wake restores cannot be discarded either.
        """
        with self._command("discard", tags=tags):
            self._guard("discard")
            tags = _tag_list(tags)
            self._check_tags("discard", tags)
            resident = [t for t in tags if t not in self.projection.asleep]
            for tag in tags:
                why = ""
                if tag == "cudagraph":
                    why = "cudagraph is never discarded: graphs hold write-once state"
                elif tag in resident and tag not in self.policy.deferrable:
                    deferrable = ", ".join(sorted(self.policy.deferrable))
                    why = f"{tag!r} is resident and every wake restores it; only {deferrable} can be discarded while resident"
                if why:
                    self._refuse(
                        "discard", InvalidTransition("discard", self.state.value, self.projection.since, (), why)
                    )
            host = [t for t in tags if t in self.projection.asleep and self.projection.residency[t].host]
            start = time.perf_counter()
            dropped: list[str] = []
            if host:
                self._group_hold(None)  # backups cannot come back: the group agrees before any is dropped
            for tag in host:
                try:
                    self.memory.drop_backup([tag])
                except TorporError as exc:
                    if not dropped:  # nothing changed yet: a refusal
                        self._refuse("discard", exc)
                    self._emit(  # some backups went already: the discard ends, partly done, and says why
                        EventKind.DISCARD_COMPLETED,
                        tags=dropped,
                        error=type(exc).__name__,
                        reason=str(exc),
                        seconds=time.perf_counter() - start,
                    )
                    raise
                dropped.append(tag)
                self._emit(EventKind.TAG_DISCARDED, tag=tag, bytes=self.projection.residency[tag].host)
            release_unused_host(self.memory, self.host_policy)
            if resident:
                self._discard_resident(resident, dropped)
            return self.projection

    def _discard_resident(self, tags: list[str], dropped: list[str]) -> None:
        """Release resident tags without a backup (each tag fully or not at all); ``dropped``: backups gone already."""
        start = time.perf_counter()
        try:
            self.memory.drop_backup(tags)  # a stale backup must never come back as their content
        except TorporError as exc:
            if not dropped:  # nothing changed yet: a refusal
                self._refuse("discard", exc)
            self._emit(  # backups of asleep tags went already: the discard ends, partly done, and says why
                EventKind.DISCARD_COMPLETED,
                tags=[],
                error=type(exc).__name__,
                reason=f"{exc} (after dropping the backups of {', '.join(dropped)})",
                seconds=time.perf_counter() - start,
            )
            raise
        was_awake = self.state is State.AWAKE
        done: list[str] = []
        error: TorporError | None = None
        for tag in tags:
            try:
                released = self.memory.release([tag])[tag]
            except TorporError as exc:
                error = exc
                break
            done.append(tag)
            self._emit(
                EventKind.TAG_RELEASED, tag=tag, bytes=released.bytes, action="discard", seconds=released.seconds
            )
        self._emit(
            EventKind.DISCARD_COMPLETED,
            tags=done,
            error=type(error).__name__ if error else None,
            reason=str(error) if error else None,
            seconds=time.perf_counter() - start,
        )
        if was_awake and done:
            self._step("discard")
        if error is not None:
            raise error
        self._group_hold(lambda exc: undo_discard(self, done, exc))

    @contextmanager
    def capture(self, site: str) -> Iterator[object]:
        """Capture one graph into the cudagraph pool; yields what ``torch.cuda.graph(pool=...)`` takes."""
        with self._command("capture", site=site):
            self._guard("capture")
            memory = self._graph_memory("capture")
            first = self.projection.pool is None
            start = time.perf_counter()
            with ExitStack() as stack:
                try:
                    pool = stack.enter_context(memory.capture_into_pool(site))
                except TorporError as exc:  # the pool could not be set up: nothing captured, say why
                    self._refuse("capture", exc)
                yield pool
            pool_name = str(pool)
            if first:
                self._emit(EventKind.POOL_CREATED, pool=pool_name)
            self._emit(
                EventKind.GRAPH_CAPTURED,
                site=site,
                pool=pool_name,
                seconds=time.perf_counter() - start,
                usage=self._resident_usage(),
            )

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool once nothing references it; return the bytes it held."""
        with self._command("release_pool"):
            memory = self._graph_memory("release_pool")
            if self.state in ASLEEP or self.state.value not in allowed_sources("release_pool"):
                reason = (
                    f"cudagraph pool is asleep (state {self.state.value!r} since event #{self.projection.since}): "
                    "freeing it would unmap a second time; wake first"
                )
                self._refuse("release_pool", PoolBusy(reason))
            holders = list(memory.cudagraph_pool_holders())
            if holders:
                reason = f"cudagraph pool is referenced by {len(holders)} holder(s) ({'; '.join(holders)}); release the graphs first"
                self._refuse("release_pool", PoolBusy(reason, holders))
            pool = self.projection.pool
            try:
                freed = memory.release_cudagraph_pool()
            except TorporError as exc:
                self._refuse("release_pool", exc)
            self._emit(EventKind.POOL_RELEASED, pool=pool, bytes=freed, usage=self._resident_usage())
            return freed

    def observe(self) -> Projection:
        """Record the memory's current per-tag bytes (a ``usage_observed`` event)."""
        with self._emit_lock:
            self._emit(EventKind.USAGE_OBSERVED, usage=self._resident_usage())
            return self.projection

    def record(self, kind: EventKind, **data: Any) -> Event:
        """Record an outside fact (hook decisions); returns the event."""
        if kind not in (EventKind.HOOK_DECISION, EventKind.USAGE_OBSERVED):
            msg = f"only hook_decision and usage_observed facts can be recorded from outside, not {kind.value!r}"
            raise ValueError(msg)
        return self._emit(kind, **data)

    def recover(self) -> Projection:
        """Accept that an interrupted transition left memory unknown; start clean from the memory as it is.

        Each tag's residency is taken from the memory: a tag with nothing
        resident and bytes on the host (or discarded) is asleep, so the
        controller ends ``awake`` when everything is resident and
        ``partially_awake`` otherwise (a wake then restores the rest).
        """
        with self._command("recover"):
            self._guard("recover")
            usage = self.memory.usage()
            released = {
                tag: {"host": u.host, "discarded": u.discarded}
                for tag, u in usage.items()
                if not u.resident and (u.host or u.discarded)
            }
            self._emit(
                EventKind.RECOVERED,
                usage={tag: u.resident for tag, u in usage.items()},
                released=released,
                interrupted_state=self.state.value,
                interrupted_step=self.projection.last_step,
            )
            self._log_failure = ""
            self._sync_machine()
            return self.projection

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return bool(self._closed_at)

    def close(self, timeout: float | None = None) -> None:
        """Record the end of this controller's life and close the log; later commands raise ``ControllerClosed``.

        A command in flight in another thread is waited for (up to ``timeout``
        seconds, None: as long as it takes; past it ``CommandInFlight`` is
        raised and nothing is closed). Called from inside a command (a
        subscriber) it raises ``CommandInFlight`` at once. Closing twice does nothing.
        """
        if self._owner == threading.get_ident():
            raise CommandInFlight("close", self._in_flight, self.state.value)
        if not self._command_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
            raise CommandInFlight("close", self._in_flight, self.state.value)
        try:
            with self._emit_lock:
                if self._closed_at:
                    return
                try:
                    event = self._emit(EventKind.CLOSED, state=self.state.value)
                    self._closed_at = event.seq
                except LogWriteFailed:
                    logger.exception("torpor: recording 'closed' failed; the log is closed anyway")
                    self._closed_at = self._seq or 1
                if self.log is not None:
                    self.log.close()
        finally:
            self._command_lock.release()

    # -- internals ------------------------------------------------------------

    @contextmanager
    def _command(self, name: str, **args: Any) -> Iterator[None]:
        if self._closed_at:
            raise ControllerClosed(name, self.engine, self.rank, self._closed_at)
        if not self._command_lock.acquire(blocking=False):
            self._refuse(name, CommandInFlight(name, self._in_flight, self.state.value))
        try:
            if self._closed_at:  # closed while this command waited for nothing: close() held the lock
                raise ControllerClosed(name, self.engine, self.rank, self._closed_at)
            self._owner = threading.get_ident()
            self._in_flight = f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"
            if self.projection.interrupted and name != "recover":
                step = self.projection.last_step
                self._refuse(
                    name, NotRecovered(self.state.value, self.projection.last_seq, step, cause=self._log_failure)
                )
            yield
        finally:
            self._in_flight = ""
            self._owner = None
            self._command_lock.release()

    def _repeated(self, command: str, args: dict[str, Any], reason: str) -> Projection:
        """Record a retried command whose effect already holds; nothing else changes."""
        self._emit(EventKind.COMMAND_REPEATED, command=command, args=args, state=self.state.value, reason=reason)
        logger.info("torpor: %s(%s) is a no-op: %s", command, args, reason)
        return self.projection

    def _note(self, ok: list[bool], kind: EventKind, **data: Any) -> bool:
        """Record a rollback step unless an earlier one could not be; False (and ``ok[0]`` False) if not recorded.

        Once one rollback event is missing, later ones would make the log say
        something the memory does not: the log then ends mid-transition and
        ``recover()`` reconciles it with the memory.
        """
        if not ok[0]:
            return False
        try:
            self._emit(kind, **data)
        except LogWriteFailed as exc:
            ok[0] = False
            self._log_failure = f"the rollback could not be recorded ({exc}); memory was rolled back"
            logger.exception("torpor: recording a rollback failed; the controller needs recover()")
            return False
        return True

    def _guard(self, command: str) -> None:
        allowed = allowed_sources(command)
        if self.state.value not in allowed:
            wall = (
                time.strftime("%H:%M:%S", time.localtime(self.projection.since_wall))
                if self.projection.since_wall
                else ""
            )
            self._refuse(
                command, InvalidTransition(command, self.state.value, self.projection.since, allowed, since_wall=wall)
            )

    def _refuse(self, command: str, error: TorporError) -> None:
        # Bounded so that a refusal of oversized input (a huge tag name) is still logged, not EventTooLarge.
        holders = [_clip(str(h), 128) for h in list(getattr(error, "holders", ()))[:16]]
        try:
            self._emit(
                EventKind.REFUSED,
                command=command,
                reason=_clip(str(error), 2048),
                error=type(error).__name__,
                holders=holders,
                state=self.state.value,
            )
        except LogWriteFailed:  # the refusal is what the caller must see; the log says why it lacks it
            logger.exception("torpor: recording the refusal of %s failed", command)
        raise error

    def _check_tags(self, command: str, tags: Sequence[str]) -> None:
        known = set(self.projection.residency) | set(self.memory.usage())
        unknown = [t for t in tags if t not in known]
        if unknown:
            self._refuse(command, UnknownTag(unknown, known))

    def _graph_memory(self, command: str) -> GraphPoolMemory:
        if not isinstance(self.memory, GraphPoolMemory):
            msg = f"cannot {command}: {type(self.memory).__name__} has no cudagraph pool"
            self._refuse(command, TorporError(msg))
        return self.memory  # type: ignore[return-value]

    def _resident_usage(self) -> dict[str, int]:
        return {tag: u.resident for tag, u in self.memory.usage().items()}

    def _sync_machine(self) -> None:
        self._machine.set_state(self.projection.state.value, self._model)

    def _step(self, trigger: str) -> None:
        """Fire an internal trigger; the machine must agree with the projection."""
        getattr(self._model, trigger)()
        if self._model.state != self.projection.state.value:
            msg = f"state machine says {self._model.state!r} after {trigger!r}, events say {self.projection.state.value!r}"
            raise TorporError(msg)

    def _emit(self, kind: EventKind, **data: Any) -> Event:
        with self._emit_lock:
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
                for callback, kinds in list(self._subscribers):
                    if kinds is not None and sent.kind not in kinds:
                        continue
                    try:
                        callback(sent)
                    except Exception:  # a subscriber must never break the controller
                        logger.exception("torpor subscriber %r failed on event #%d %s", callback, sent.seq, sent.kind)
            return event

    def _sleep(self, level: int) -> Projection:
        start = time.perf_counter()
        usage = self._resident_usage()
        candidates = [t for t in usage if t not in set(self.projection.asleep_tags())]
        plan = self.policy.plan(level, candidates)
        offloading = backup_bytes(self.memory, [t for t, a in plan.items() if a is Action.OFFLOAD], usage)
        over = budget_refusal(self.host_policy, self.projection, offloading)
        if over is not None:  # before anything is touched
            self._refuse("sleep", over)
        self._emit(EventKind.SLEEP_REQUESTED, level=level, plan={t: a.value for t, a in plan.items()}, usage=usage)
        self._step("sleep")
        offload = [t for t, a in plan.items() if a is Action.OFFLOAD]
        discard = [t for t, a in plan.items() if a is Action.DISCARD]
        released: list[Transfer] = []
        backed_up: list[str] = []  # tags with a backup this sleep made (dropped again if it aborts)
        phase, failed = "backup", None
        undone = False

        def undo_group(exc: TorporError) -> None:  # another rank failed: roll back here, then raise
            nonlocal undone
            undone = True
            self._abort_sleep(level, start, "group", exc, released, plan, backed_up, None)

        try:
            self.memory.drop_backup(discard)  # a stale backup must never come back as a discarded tag's content
            backed = self.memory.backup(offload)
            backed_up = offload
            for tag in offload:
                t = backed[tag]
                self._emit(EventKind.TAG_BACKED_UP, tag=tag, bytes=t.bytes, seconds=t.seconds)
            phase = "release"
            for tag in offload + discard:  # offloaded tags first: a failure then loses nothing
                if plan[tag] is Action.DISCARD:  # with a group: every rank agrees before anything is discarded
                    self._group_hold(undo_group)
                failed = tag
                done = self.memory.release([tag])[tag]
                released.append(done)
                failed = None
                self._emit(
                    EventKind.TAG_RELEASED, tag=tag, bytes=done.bytes, action=plan[tag].value, seconds=done.seconds
                )
            self._group_hold(undo_group)
            phase = "recording"
            seconds = time.perf_counter() - start
            offloaded = sum(t.bytes for t in released if plan[t.tag] is Action.OFFLOAD)
            discarded = sum(t.bytes for t in released if plan[t.tag] is Action.DISCARD)
            self._emit(
                EventKind.SLEEP_COMPLETED,
                level=level,
                seconds=seconds,
                freed=offloaded + discarded,
                offloaded=offloaded,
                discarded=discarded,
                pinned=self._pinned_bytes(),
                host_budget=self.host_policy.budget_bytes,
                device=device_report(self.memory),
            )
        except BaseException as exc:  # an error, an interrupt, a log that cannot be written: roll back, raise
            if undone or self.projection.state is not State.SUSPENDING:  # undone for the group, or the sleep stands
                self._sync_machine()
                raise
            self._abort_sleep(level, start, phase, exc, released, plan, backed_up, failed)
        self._step("finish_sleep")
        logger.info(
            "sleep freed %.2f GiB (%.2f GiB to host, %.2f GiB discarded) in %.2f s",
            (offloaded + discarded) / GiB,
            offloaded / GiB,
            discarded / GiB,
            seconds,
        )
        return self.projection

    def _abort_sleep(
        self,
        level: int,
        start: float,
        phase: str,
        exc: BaseException,
        released: list[Transfer],
        plan: Mapping[str, Action],
        backed_up: list[str],
        failed: str | None,
    ) -> None:
        """Undo a sleep that failed: map back what was released, drop backups, stay awake; raise ``exc``."""
        ok = [True]
        rollback_error: BaseException | None = None
        # A discarded tag had no backup: rolling it back maps fresh memory, its content is gone. Say so.
        # The tag whose release failed may be partly released already (some allocations unmapped).
        lost = [t.tag for t in released if plan.get(t.tag) is Action.DISCARD]
        if failed is not None and plan.get(failed) is Action.DISCARD:
            lost.append(failed)
        for done in reversed(released):
            try:
                back = self.memory.restore([done.tag])[done.tag]
            except BaseException as again:  # the first error is raised below
                rollback_error = again
                break
            self._note(
                ok,
                EventKind.TAG_RESTORED,
                tag=done.tag,
                bytes=back.bytes,
                source="rollback",
                seconds=back.seconds,
                lost=done.tag in lost,
            )
        if rollback_error is not None:
            # Could not undo: what is released stays released; the sleep completes as far as it got.
            if self._note(
                ok,
                EventKind.SLEEP_COMPLETED,
                level=level,
                seconds=time.perf_counter() - start,
                freed=0,
                offloaded=0,
                discarded=0,
                pinned=self._pinned_bytes(),
                incomplete=str(rollback_error),
            ):
                self._step("finish_sleep")
            if not isinstance(exc, Exception):  # an interrupt stays an interrupt
                raise exc
            raise MemoryOperationFailed(
                "sleep rollback", None, f"{exc}; rolling back failed too: {rollback_error}"
            ) from exc
        interrupt: BaseException | None = None
        if backed_up:  # backup() cleans up its own failure
            try:
                self.memory.drop_backup(backed_up)
            except Exception:
                logger.exception("dropping backups after an aborted sleep failed")
            except BaseException as again:  # an interrupt while dropping: the backups leak, the abort goes on
                interrupt = again
        release_unused_host(self.memory, self.host_policy)
        lost_txt = (
            f"; content of {', '.join(lost)} may be lost (discarded, or partly, before the failure)" if lost else ""
        )
        if self._note(
            ok,
            EventKind.SLEEP_ABORTED,
            level=level,
            reason=f"{phase} failed: {exc}{lost_txt}",
            error=type(exc).__name__,
            seconds=time.perf_counter() - start,
            usage=self._resident_usage(),
            lost=lost,
        ):
            self._step("abort_sleep")
        if released:
            logger.warning("Rolled back %d released tag(s) after a failed sleep%s", len(released), lost_txt)
        if interrupt is not None and isinstance(exc, Exception):
            raise interrupt from exc
        raise exc

    def _wake(self, tags: list[str] | None) -> Projection:
        start = time.perf_counter()
        if tags is not None:
            self._check_tags("wake", tags)
        restoring = self.policy.wake_set(tags, self.projection.asleep_tags())
        self._emit(EventKind.WAKE_REQUESTED, tags=tags, restoring=restoring)
        self._step("wake")
        restored: list[tuple[str, Transfer, str]] = []
        undone = False

        def undo_group(exc: TorporError) -> None:  # another rank failed: roll back here, then raise
            nonlocal undone
            undone = True
            self._fail_wake(tags, start, exc, restored)

        try:
            for tag in restoring:
                source = "host" if self.projection.residency[tag].host else "fresh"
                done = self.memory.restore([tag])[tag]
                restored.append((tag, done, source))
                self._emit(EventKind.TAG_RESTORED, tag=tag, bytes=done.bytes, source=source, seconds=done.seconds)
            self._group_hold(undo_group)  # backups kept until the group agrees
        except BaseException as exc:  # an error, an interrupt, a log that cannot be written: roll back, raise
            if undone:  # the group's rollback ran already
                raise
            self._fail_wake(tags, start, exc, restored)
        interrupt: BaseException | None = None
        try:
            self.memory.drop_backup([t for t, _, _ in restored])
        except Exception:
            logger.exception("dropping backups after a wake failed; the wake itself succeeded")
        except BaseException as exc:  # an interrupt here: every tag is back, the wake stands; raised once recorded
            interrupt = exc
        host_released = release_unused_host(self.memory, self.host_policy)
        seconds = time.perf_counter() - start
        try:
            self._emit(
                EventKind.WAKE_COMPLETED,
                tags=tags,
                seconds=seconds,
                restored=sum(t.bytes for _, t, _ in restored),
                pinned=self._pinned_bytes(),
                host_released=host_released,
            )
        except LogWriteFailed as exc:  # every tag is back and its backup gone: nothing to roll back to
            self._log_failure = f"the end of a wake could not be recorded ({exc}); every tag asked for is resident"
            raise
        self._step("finish_wake")
        if interrupt is not None:
            raise interrupt
        return self.projection

    def _fail_wake(
        self, tags: list[str] | None, start: float, exc: BaseException, restored: list[tuple[str, Transfer, str]]
    ) -> None:
        ok = [True]
        if restored:
            logger.warning("Rolling back %d mapped tag(s)", len(restored))
        for tag, done, source in reversed(restored):
            action = "offload" if source == "host" else "discard"
            try:
                self.memory.release([tag])
            except BaseException:  # the first error is raised below
                logger.exception("rolling back tag %r after a failed wake failed; it stays resident", tag)
                continue
            self._note(ok, EventKind.TAG_ROLLED_BACK, tag=tag, bytes=done.bytes, action=action)
        if self._note(
            ok,
            EventKind.WAKE_FAILED,
            tags=tags,
            reason=str(exc),
            error=type(exc).__name__,
            seconds=time.perf_counter() - start,
        ):
            self._step("fail_wake")
        raise exc

    def _group_hold(self, undo: Callable[[TorporError], None] | None) -> None:
        """With a group: the local part is prepared; vote, and ``undo`` it (then raise) when a rank failed."""
        if self.group is not None:
            self.group.hold(self, undo)

    def _pinned_bytes(self) -> int:
        pinned = getattr(self.memory, "pinned_bytes", None)
        return int(pinned()) if callable(pinned) else 0
