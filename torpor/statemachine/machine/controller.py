"""The SleepController: guards every memory command, plans it, drives the memory, records events.

The flow has one direction: a command is guarded by the transition table (one
verdict per state and command, :func:`torpor.statemachine.core.states.decide`, and
nothing else decides whether a state accepts a command), planned by the
policy, executed by the memory object (mechanism only), and recorded as
events; the state and per-tag residency are a projection of those events, the
same one :func:`torpor.statemachine.replay` computes from the log, and the
events move it only along the table's edges (the tests check each one). There
is one state model: no ``transitions.Machine`` or other object holds a second
copy of the state (:mod:`torpor.statemachine.core.states` says why).
Subscribers (telemetry, RL feeds) are called after each event and can never
break the controller. Commands are serialized: one arriving while another is in
flight is refused (``CommandInFlight``), never queued behind a lock.

Anything raised inside a sleep or a wake (a memory error, a ``KeyboardInterrupt``,
a log that cannot be written) rolls the command back, then is raised again. When
the rollback itself cannot be recorded the controller stays in the transitional
state and refuses with ``NotRecovered`` until :meth:`SleepController.recover`,
which takes each tag's residency from the memory as it is.

:class:`SleepController` holds the commands; it is composed of parts it owns,
each with its own state and module:

- :class:`~torpor.statemachine.machine.recorder.Recorder`: events from typed
  payloads, the log, the projection, the subscribers;
- :class:`~torpor.statemachine.machine.gate.Gate`: one command at a time, the
  guard (the table's verdict, and the error it names), refusals and idempotent no-ops;
- :class:`~torpor.statemachine.machine.hostmem.HostSide`: the host-memory policy's side;
- :class:`~torpor.statemachine.machine.group.GroupMember`: the votes of a process group;
- the steps, functions of one :class:`~torpor.statemachine.machine.context.Context`:
  :mod:`~torpor.statemachine.machine.sleeping`, :mod:`~torpor.statemachine.machine.waking`,
  :mod:`~torpor.statemachine.machine.discarding`, :mod:`~torpor.statemachine.machine.graphs`,
  :mod:`~torpor.statemachine.machine.tracking`, :mod:`~torpor.statemachine.machine.recovery`
  and :mod:`~torpor.statemachine.machine.rollback` (every compensating step).

The memory's capabilities are asked once, here, when the controller is made
(:meth:`~torpor.statemachine.core.protocol.Abilities.of`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from torpor.errors import BadArgument, TorporError
from torpor.statemachine.core.events import PAYLOADS, Event, EventKind, Opened, UsageObserved
from torpor.statemachine.core.policy import DEFAULT_POLICY, WEIGHTS, Policy
from torpor.statemachine.core.protocol import Abilities, Memory
from torpor.statemachine.core.states import State
from torpor.statemachine.core.timeouts import timeout_seconds
from torpor.statemachine.log.eventlog import EventLog
from torpor.statemachine.machine import discarding, graphs, recovery, sleeping, tracking, waking
from torpor.statemachine.machine.context import Context
from torpor.statemachine.machine.gate import Gate
from torpor.statemachine.machine.group import DEFAULT_TIMEOUT, GroupMember, as_agreement
from torpor.statemachine.machine.hostmem import HostSide
from torpor.statemachine.machine.identity import check_identity, log_path_for, names_a_directory, open_log
from torpor.statemachine.machine.recorder import Recorder, Subscriber
from torpor.statemachine.projection.view import Projection

__all__ = ["SleepController", "Subscriber", "log_path_for"]

R = TypeVar("R")

#: The kinds :meth:`SleepController.record` takes from outside: facts no command of the controller records.
OUTSIDE_FACTS = (EventKind.HOOK_DECISION, EventKind.USAGE_OBSERVED, EventKind.BACKUP_ADOPTED)


class SleepController:
    """Guards, plans and records every memory command of one engine rank.

    ``memory`` meets :class:`~torpor.statemachine.core.protocol.Memory`; ``log`` is
    an :class:`EventLog`, a file path (an existing file, or a new path with a
    suffix such as ``.jsonl``), a directory (an existing one, a path ending in
    ``/``, or a new path without a suffix; the file is ``ENGINE.rankN.jsonl``
    inside it) or None (events kept in memory only). ``rank`` is an int
    0..2**63-1 and, with a directory, ``engine`` a plain file name (no
    separator, not ``..``): both are checked before any file is made
    (:func:`~torpor.statemachine.machine.identity.check_identity`). Opening an
    existing log reads it from the snapshot that opens its newest file, not
    its whole history.

    ``group`` (a ``torch.distributed`` process group of any backend, whose
    rendezvous store carries the votes, or any
    :class:`~torpor.statemachine.machine.group.Agreement`) makes ``sleep``, ``wake``
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
        names_file = isinstance(log, str | Path) and names_a_directory(Path(log), str(log))
        check_identity(engine, rank, names_file=names_file)  # before anything is made: a file, the host policy
        abilities = Abilities.of(memory)  # the one place the memory's capabilities are asked
        self.memory = memory
        self.policy = policy or DEFAULT_POLICY
        self.host_policy = self.policy.host_policy()
        host = HostSide(abilities, self.host_policy)
        host.apply(self.policy.never_backed_up())
        self.engine = engine
        self.rank = rank
        member = None if group is None else GroupMember(as_agreement(group), group_timeout)
        self.log: EventLog | None = open_log(log, engine, rank, fsync=fsync)
        self._recorder = Recorder(engine, rank, self.log, keep_events)
        self._gate = Gate(self._recorder)
        self._ctx = Context(memory, abilities, self.policy, host, self._recorder, self._gate, member)
        if not self._recorder.projection.interrupted:
            self._recorder.record(
                Opened(
                    usage=self._ctx.resident_usage(),
                    allocations=self._ctx.allocation_counts(),
                    memory=type(memory).__name__,
                    previous_state=self.projection.state.value if self._recorder.seq else None,
                    host=self.host_policy.to_dict(),
                )
            )

    @contextmanager
    def _command(self, name: str, **args: Any) -> Iterator[None]:
        """Run the block as command ``name`` through the gate; an interrupt mid-transition is reconciled before it is raised."""
        with self._gate.command(name, **args):
            try:
                yield
            except BaseException as exc:  # an interrupt, or whatever a signal handler raised: the process lives on
                recovery.settle(self._ctx, name, exc)
                raise

    def _collectively(self, command: str, run: Callable[[], R]) -> R:
        """``run()`` the command: with a group, as the group's next collective command; alone otherwise."""
        group = self._ctx.group
        return run() if group is None else group.run(self._ctx, command, run)

    # -- the memory commands ----------------------------------------------------

    def sleep(self, level: int = 1, *, idempotent: bool = False) -> Projection:
        """Put the engine to sleep at ``level`` (1 or 2); return the resulting projection.

        ``idempotent``: a sleep while already asleep at ``level`` or deeper is a
        no-op recorded as ``command_repeated`` instead of a refusal (what an
        orchestrator that retries on every rank needs; the vLLM backend sets it).
        """

        def run() -> Projection:
            with self._command("sleep", level=level):
                return sleeping.sleep(self._ctx, level, idempotent)

        return self._collectively("sleep", run)

    def wake(self, tags: Sequence[str] | str | None = None, *, idempotent: bool = False) -> Projection:
        """Wake ``tags`` (None: all); every non-deferrable tag is restored by any wake.

        An empty list names no tag and is refused (``NoTagsNamed``, recorded as
        ``refused``) in every state: it is most often a filter upstream that came
        out empty, and waking only the tags every wake restores would leave the
        engine ``partially_awake`` with nothing it asked for.

        ``idempotent``: a wake that would restore nothing (every tag asked for,
        and every tag any wake restores, is resident) is a no-op recorded as
        ``command_repeated`` instead of a refusal; unknown tags are still refused.
        """

        def run() -> Projection:
            with self._command("wake", tags=tags):
                return waking.wake(self._ctx, tags, idempotent)

        return self._collectively("wake", run)

    def discard(self, tags: Sequence[str] | str) -> Projection:
        """Discard ``tags``; the next wake that restores them maps fresh memory.

        An asleep tag loses its host backup. A resident deferrable tag (``weights``,
        ``kv_cache``) is released without a backup, as vLLM's
        ``release_kv_cache_memory()`` asks, and an awake engine becomes
        ``partially_awake``. ``cudagraph`` is never discarded, and a resident tag
        that every wake restores cannot be discarded either.
        """

        def run() -> Projection:
            with self._command("discard", tags=tags):
                return discarding.discard(self._ctx, tags)

        return self._collectively("discard", run)

    @contextmanager
    def capture(self, site: str) -> Iterator[object]:
        """Capture one graph into the cudagraph pool; yields what ``torch.cuda.graph(pool=...)`` takes."""
        with self._command("capture", site=site), graphs.capture(self._ctx, site) as pool:
            yield pool

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool once nothing references it; return the bytes it held."""
        with self._command("release_pool"):
            return graphs.release_pool(self._ctx)

    def track(self, module: object, tag: str = WEIGHTS, *, check: bool = True) -> object:
        """Keep ``module``'s state that no ``state_dict`` reload restores across each discard of ``tag``.

        ``module``: a ``torch.nn.Module`` whose parameters live in ``tag``
        (built inside ``use_memory_pool(tag)``), or any keep source of the
        memory's. Returns the memory's tracker; for a module its
        ``check_reloaded()`` raises ``NotReloaded`` naming each parameter or
        persistent buffer the reload left unwritten after a wake without a
        backup (``check``: the wake fills them with 0xFF first), and
        ``untrack()`` stops keeping it. Refused (``TrackRefused``) when the
        memory cannot keep ranges or the policy never discards ``tag``.
        """
        return tracking.track(self._ctx, module, tag, check=check)

    # -- the lifecycle ------------------------------------------------------------

    def observe(self) -> Projection:
        """Record the memory's current per-tag bytes (a ``usage_observed`` event)."""
        with self._recorder.lock:
            self._recorder.record(
                UsageObserved(usage=self._ctx.resident_usage(), allocations=self._ctx.allocation_counts())
            )
            return self.projection

    def record(self, kind: EventKind, **data: Any) -> Event:
        """Record an outside fact (hook decisions, a keeper's backup adopted); returns the event."""
        if kind not in OUTSIDE_FACTS:
            msg = (
                "only hook_decision, usage_observed and backup_adopted facts can be recorded from outside, "
                f"not {kind.value!r}"
            )
            raise BadArgument(msg)
        return self._recorder.record(PAYLOADS[kind](data))

    def recover(self) -> Projection:
        """Accept that an interrupted transition left memory unknown; start clean from the memory as it is.

        Each tag's residency is taken from the memory: a tag with nothing
        resident and bytes on the host (or discarded) is asleep, so the
        controller ends ``awake`` when everything is resident and
        ``partially_awake`` otherwise (a wake then restores the rest).
        """
        with self._command("recover"):
            self._gate.guard("recover")
            return recovery.reconcile(self._ctx)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return bool(self._recorder.closed_at)

    def close(self, timeout: float | None = None) -> None:
        """Record the end of this controller's life and close the log; later commands raise ``ControllerClosed``.

        A command in flight in another thread is waited for (up to ``timeout``
        seconds, None: as long as it takes; past it ``CommandInFlight`` is
        raised and nothing is closed). Called from inside a command (a
        subscriber) it raises ``CommandInFlight`` at once. Closing twice does nothing.
        """
        with self._gate.exclusive("close", timeout):
            self._recorder.close()

    # -- reading --------------------------------------------------------------

    @property
    def projection(self) -> Projection:
        """The fold of every event so far: the state and each tag's residency (the recorder's)."""
        return self._recorder.projection

    @property
    def state(self) -> State:
        """The current state (a projection of the events)."""
        return self._recorder.projection.state

    @property
    def last_seq(self) -> int:
        """Sequence number of the last event recorded."""
        return self._recorder.seq

    @property
    def log_path(self) -> Path:
        """The file of the event log this controller writes; ``TorporError`` when it keeps none (made with ``log=None``)."""
        if self.log is None:
            msg = f"the controller of engine {self.engine!r} rank {self.rank} keeps no event log (made with log=None)"
            raise TorporError(msg)
        return self.log.path

    @property
    def group(self) -> GroupMember | None:
        """This rank's membership in a group (sleep, wake and discard are collective), or None."""
        return self._ctx.group

    @group.setter
    def group(self, member: GroupMember | None) -> None:
        self._ctx.group = member  # the vLLM backend joins a group after the controller is made

    def events(self, after: int = 0) -> list[Event]:
        """Recent events (up to ``keep_events``) with a sequence number above ``after``."""
        return self._recorder.events(after)

    def subscribe(self, callback: Subscriber, kinds: Iterable[EventKind | str] | None = None) -> Callable[[], None]:
        """Call ``callback(event)`` after each event (of ``kinds``); return an unsubscribe function."""
        return self._recorder.subscribe(callback, kinds)

    def wait_for(self, state: State | str, timeout: float | None = None) -> bool:
        """Block until the controller is in ``state``; False after ``timeout`` seconds (None: no end).

        A timeout is finite seconds >= 0 (:func:`~torpor.statemachine.core.timeouts.timeout_seconds`):
        ``nan``, ``inf`` or a negative number is a ``ValueError`` at once (``nan`` used to block forever).
        """
        return self._recorder.wait_for(state, _timeout(timeout))

    async def wait_for_async(self, state: State | str, timeout: float | None = None) -> bool:
        """Asyncio variant of :meth:`wait_for` (the same timeouts refused); never blocks the event loop."""
        return await self._recorder.wait_for_async(state, _timeout(timeout))


def _timeout(timeout: object) -> float | None:
    """A wait's ``timeout``: None (no end), else finite seconds >= 0, refused before anything is waited for."""
    return (
        None
        if timeout is None
        else timeout_seconds(timeout, refused=" (or None to wait without end); nothing was waited for")
    )
