"""Groups: the ranks of one tensor-parallel engine sleep, wake and discard all or nothing.

With a group, ``sleep``, ``wake`` and ``discard`` of a :class:`~torpor.SleepController`
are collective and run in three steps on every rank:

1. prepare: the command does its local part up to the point where it could
   still be undone (a sleep backs up and releases the offloaded tags but
   discards nothing; a wake maps and restores but keeps the host backups; a
   discard releases resident tags but drops no backup);
2. agree: the rank votes (ok, or why not) and every rank learns every vote
   through an :class:`Agreement`; a rank that does not vote within the
   timeout counts as failed;
3. commit when every rank voted ok (the rest of the command: discard, drop
   backups), else compensate: every rank undoes its prepared part and raises
   :class:`~torpor.errors.GroupFailed` naming the failed ranks.

A rank whose command fails or is refused before it votes has already undone
its own part (the controller's usual rollback); it votes no. A command that
changes nothing (a refusal, a no-op) votes after it returns. The outcome is
recorded on every rank as a ``group_agreed`` event, which ``fleet()`` and
``torpor status`` compare across ranks.

This module imports no torch: the agreement is a small protocol with two
implementations, :class:`LocalGroup` (threads of one process, for tests) and
``torpor.hooks.distributed.TorchGroup`` (a torch.distributed gloo group),
which :func:`as_agreement` picks for a ``ProcessGroup``. Without a group
nothing here runs.
"""

from __future__ import annotations

import functools
import importlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, runtime_checkable

from torpor.errors import CommandInFlight, GroupFailed, TorporError
from torpor.statemachine.events import Event, EventKind
from torpor.statemachine.states import State

#: Seconds a rank waits for the others' votes before it counts them as failed.
DEFAULT_TIMEOUT = 120.0
#: Bytes of one encoded vote (reasons are cut to fit).
VOTE_BYTES = 2048
#: What an :class:`Agreement` returns for a rank it could not hear from while another rank's absence explains it.
UNHEARD = b""

P = ParamSpec("P")
R = TypeVar("R")


class Participant(Protocol):
    """What a group needs of the controller it runs commands for (``SleepController`` meets it)."""

    group: GroupMember | None

    @property
    def state(self) -> State:
        """The controller's current state."""
        ...

    def _refuse(self, command: str, error: TorporError) -> None: ...

    def _emit(self, kind: EventKind, **data: Any) -> Event: ...


C = TypeVar("C", bound=Participant)


@runtime_checkable
class Agreement(Protocol):
    """How the ranks of a group learn each other's votes.

    ``exchange(round, vote, timeout)`` sends this rank's encoded vote and
    returns every rank's, indexed by rank: ``None`` for a rank that did not
    answer within ``timeout`` seconds (dead, hung, or too slow),
    :data:`UNHEARD` for one whose vote never arrived only because another
    rank's absence cut the exchange. Every rank that completes the exchange
    must get the same list. It never raises for a missing rank.
    """

    rank: int
    size: int
    name: str

    def exchange(self, round: int, vote: bytes, timeout: float) -> list[bytes | None]:
        """Every rank's vote for command number ``round``."""
        ...


@dataclass(frozen=True)
class Vote:
    """One rank's vote on one collective command."""

    rank: int
    round: int
    command: str
    ok: bool
    reason: str = ""
    wall: float = 0.0

    def encode(self) -> bytes:
        """Compact JSON of at most :data:`VOTE_BYTES` bytes (the reason is cut to fit)."""
        reason = self.reason
        while True:
            raw = json.dumps(
                {"r": self.rank, "n": self.round, "c": self.command, "ok": self.ok, "why": reason, "t": self.wall},
                separators=(",", ":"),
            ).encode()
            if len(raw) <= VOTE_BYTES:
                return raw
            reason = reason[: max(0, len(reason) - (len(raw) - VOTE_BYTES) - 16)] + "..."

    @classmethod
    def decode(cls, raw: bytes) -> Vote:
        """Inverse of :meth:`encode` (trailing zero bytes ignored)."""
        d = json.loads(raw.rstrip(b"\0").decode())
        return cls(int(d["r"]), int(d["n"]), str(d["c"]), bool(d["ok"]), str(d["why"]), float(d["t"]))


def decide(raw: list[bytes | None], timeout: float) -> dict[int, str]:
    """The failed ranks and why, from every rank's vote (the same answer on every rank for the same list)."""
    failed: dict[int, str] = {}
    votes: dict[int, Vote] = {}
    for rank, item in enumerate(raw):
        if item is None:
            failed[rank] = f"no vote within {timeout:g} s (the rank died, hangs, or is slower than the group timeout)"
        elif item != UNHEARD:
            try:
                votes[rank] = Vote.decode(item)
            except (ValueError, KeyError, TypeError) as exc:
                failed[rank] = f"unreadable vote ({type(exc).__name__}: {exc})"
    if votes:  # ranks must agree on which command this is: the most common one (lowest rank on a tie) is it
        counts = Counter((v.round, v.command) for v in votes.values())
        top = max(counts.values())
        ref = next((v.round, v.command) for _, v in sorted(votes.items()) if counts[(v.round, v.command)] == top)
        for rank, v in sorted(votes.items()):
            if (v.round, v.command) != ref:
                failed[rank] = f"ran {v.command} as group command #{v.round} while the others ran {ref[1]} as #{ref[0]}"
            elif not v.ok:
                failed[rank] = v.reason
    return dict(sorted(failed.items()))


class LocalGroup:
    """A group of ``size`` ranks that are threads of one process (tests, and examples without torch).

    ``LocalGroup.make(n)`` returns one member per rank; give each to the
    controller of one thread. A rank whose thread never votes counts as
    failed after the timeout, as a dead process would.
    """

    def __init__(self, shared: _LocalShared, rank: int) -> None:
        self._shared = shared
        self.rank = rank
        self.size = shared.size
        self.name = shared.name

    @classmethod
    def make(cls, size: int, name: str = "local") -> list[LocalGroup]:
        """One member per rank of a new group."""
        shared = _LocalShared(size, name)
        return [cls(shared, r) for r in range(size)]

    def exchange(self, round: int, vote: bytes, timeout: float) -> list[bytes | None]:
        """Post the vote; wait until every rank posted for ``round`` or the timeout passed."""
        s = self._shared
        deadline = time.monotonic() + timeout
        with s.cond:
            if round not in s.final:  # a rank that comes after the list was fixed reads that list
                s.votes.setdefault(round, {})[self.rank] = vote
                s.cond.notify_all()
            while round not in s.final:
                got = s.votes[round]
                if len(got) == self.size or deadline - time.monotonic() <= 0:
                    # complete, or the first rank to time out fixes the list for everyone
                    s.final[round] = [got.get(r) for r in range(self.size)]
                    s.cond.notify_all()
                    break
                s.cond.wait(deadline - time.monotonic())
            return list(s.final[round])


class _LocalShared:
    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self.cond = threading.Condition()
        self.votes: dict[int, dict[int, bytes]] = {}
        self.final: dict[int, list[bytes | None]] = {}


def as_agreement(group: object) -> Agreement:
    """An :class:`Agreement` as given, or a ``torch.distributed`` process group wrapped in ``TorchGroup``."""
    if isinstance(group, Agreement):
        return group
    if type(group).__module__.startswith("torch"):
        adapter = importlib.import_module("torpor.hooks.distributed")  # imports torch: only for a torch group
        wrapped: Agreement = adapter.TorchGroup(group)
        return wrapped
    msg = (
        f"group must be a torch.distributed ProcessGroup (gloo) or an object meeting torpor's Agreement "
        f"protocol (rank, size, name, exchange), not {type(group).__name__}"
    )
    raise TypeError(msg)


@dataclass
class _Txn:
    command: str
    round: int
    voted: bool = False


@dataclass(frozen=True)
class Outcome:
    """What the group agreed on one command."""

    group: str
    command: str
    round: int
    size: int
    failed: dict[int, str]
    seconds: float

    @property
    def ok(self) -> bool:
        """True when every rank voted ok in time."""
        return not self.failed

    def error(self) -> GroupFailed:
        """The :class:`GroupFailed` every rank raises for this outcome."""
        return GroupFailed(self.command, self.group, self.round, self.size, self.failed)


class GroupMember:
    """A controller's membership in a group: runs its collective commands and holds the agreement."""

    def __init__(self, agreement: Agreement, timeout: float = DEFAULT_TIMEOUT) -> None:
        if timeout <= 0:
            msg = f"group timeout must be positive seconds, got {timeout!r}"
            raise ValueError(msg)
        self.agreement = agreement
        self.timeout = float(timeout)
        self.round = 0
        self._lock = threading.Lock()
        self._txn: _Txn | None = None
        self.last: Outcome | None = None

    def run(
        self, ctl: Participant, command: str, method: Callable[..., R], args: tuple[Any, ...], kw: dict[str, Any]
    ) -> R:
        """Run ``method`` as the group's next command: vote, and commit or compensate with every rank."""
        if not self._lock.acquire(blocking=False):
            running = self._txn.command if self._txn else "a group command"
            ctl._refuse(command, CommandInFlight(command, f"{running} (collective)", ctl.state.value))
        try:
            self.round += 1
            txn = self._txn = _Txn(command, self.round)
            try:
                result = method(ctl, *args, **kw)
            except BaseException as exc:
                if txn.voted:  # GroupFailed after compensating, or a failure after the group committed
                    raise
                outcome = self._vote(ctl, txn, ok=False, reason=f"{type(exc).__name__}: {exc}")
                if isinstance(exc, Exception) and not outcome.ok:
                    raise outcome.error() from exc
                raise
            if not txn.voted:  # nothing to undo (a no-op): vote after the fact
                outcome = self._vote(ctl, txn, ok=True)
                if not outcome.ok:
                    raise outcome.error()
            return result
        finally:
            self._txn = None
            self._lock.release()

    def hold(self, ctl: Participant, undo: Callable[[TorporError], None] | None) -> None:
        """The command's local part is prepared: vote ok; when another rank failed, ``undo`` it and raise."""
        txn = self._txn
        if txn is None or txn.voted:
            return
        outcome = self._vote(ctl, txn, ok=True)
        if outcome.ok:
            return
        error = outcome.error()
        if undo is not None:
            undo(error)  # raises ``error`` once undone (or a worse error when undoing failed)
        raise error

    def _vote(self, ctl: Participant, txn: _Txn, ok: bool, reason: str = "") -> Outcome:
        txn.voted = True
        a = self.agreement
        vote = Vote(a.rank, txn.round, txn.command, ok, reason, time.time())
        start = time.perf_counter()
        try:
            raw = a.exchange(txn.round, vote.encode(), self.timeout)
        except Exception:  # an adapter must not raise; if it does, nobody else was heard
            raw = [vote.encode() if r == a.rank else None for r in range(a.size)]
        failed = decide(raw, self.timeout)
        outcome = Outcome(a.name, txn.command, txn.round, a.size, failed, time.perf_counter() - start)
        self.last = outcome
        ctl._emit(
            EventKind.GROUP_AGREED,
            group=outcome.group,
            command=outcome.command,
            round=outcome.round,
            size=outcome.size,
            result="commit" if outcome.ok else "rollback",
            failed={str(r): why[:512] for r, why in failed.items()},
            voted=ok,
            seconds=outcome.seconds,
        )
        return outcome


def collective(
    command: str,
) -> Callable[[Callable[Concatenate[C, P], R]], Callable[Concatenate[C, P], R]]:
    """Decorate a controller command: with a group it runs collectively, without one it runs as written."""

    def wrap(method: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[C, P], R]:
        def run(self: C, /, *args: P.args, **kw: P.kwargs) -> R:
            member = self.group
            if member is None:
                return method(self, *args, **kw)
            return member.run(self, command, method, args, kw)

        functools.update_wrapper(run, method)
        return run

    return wrap
