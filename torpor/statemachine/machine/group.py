"""Groups: the ranks of one tensor-parallel engine sleep, wake and discard all or nothing.

With a group, ``sleep``, ``wake`` and ``discard`` of a :class:`~torpor.SleepController`
are collective, in three steps on every rank (docs/groups.md): prepare the
local part up to where it can still be undone; vote in the command's round
and learn the round's outcome through an :class:`Agreement` (a rank silent
past the timeout counts as failed); commit only when this rank knows every
rank voted ok, else (doubt included) undo and raise
:class:`~torpor.errors.GroupFailed` naming the failed ranks. A rank whose
command failed or was refused has undone its part already and votes no; a
command that changes nothing votes after it returns. Every rank records the
outcome as a ``group_agreed`` event (``fleet()`` and ``torpor status``
compare them).

A round is fixed when the command starts (:meth:`Agreement.begin`): the
group's first round not decided yet, so a rank that ran a command alone, or
reopened its controller, joins the next round instead of reading an old one.
No wall clock is compared across ranks.

No torch here: :class:`LocalGroup` (threads of one process) and
``torpor.torchgroup.TorchGroup`` (any ``torch.distributed`` group)
implement the protocol. This module never imports the hooks: the package
``torpor`` hands the torch adapter down when it loads (:func:`adapt_groups`),
and :func:`as_agreement` asks the adapters it was given.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol, TypeVar, runtime_checkable

from torpor.errors import BadArgument, BadArgumentType, CommandInFlight, GroupFailed, GroupLost, TorporError
from torpor.statemachine.core.events import Event, GroupAgreed
from torpor.statemachine.core.fields import Payload
from torpor.statemachine.core.states import State

#: Seconds a rank waits for the others' votes before it counts them as failed.
DEFAULT_TIMEOUT = 120.0
#: The longest group timeout accepted (a day): the store's waits take milliseconds in a C++ integer.
MAX_TIMEOUT = 86_400.0
#: Bytes of one encoded vote (reasons are cut to fit).
VOTE_BYTES = 2048
#: What an :class:`Agreement` returns for a rank whose vote it does not know (never a commit: see :func:`decide`).
UNHEARD = b""

R = TypeVar("R")


class Participant(Protocol):
    """What a group needs of the controller it runs commands for (the controller's ``Context`` meets it)."""

    @property
    def state(self) -> State:
        """The controller's current state."""
        ...

    def refuse(self, command: str, error: TorporError) -> NoReturn:
        """Record the refusal of ``command`` and raise ``error``."""
        ...

    def record(self, payload: Payload) -> Event:
        """Record one event."""
        ...


def check_timeout(value: object, what: str = "group timeout") -> float:
    """``value`` as seconds when it is a finite number in (0, :data:`MAX_TIMEOUT`], else ``ValueError`` saying why."""
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT):
        msg = f"{what} must be a number of seconds above 0 and at most {MAX_TIMEOUT:g} (a day), got {value!r}"
        raise BadArgument(msg)
    return seconds


def parse_timeout(raw: str | None, variable: str) -> float:
    """The group timeout from an environment variable's text (:data:`DEFAULT_TIMEOUT` when unset or empty)."""
    if raw is None or not raw.strip():
        return DEFAULT_TIMEOUT
    return check_timeout(raw.strip(), f"${variable} (the group timeout)")


@runtime_checkable
class Agreement(Protocol):
    """How the ranks of a group learn each other's votes.

    ``begin(timeout)``, when a command starts: its round, the group's first not
    decided yet and not used by this member. ``exchange(round, vote, timeout)``:
    the round's outcome as every rank's vote (``None``: no vote within
    ``timeout``; :data:`UNHEARD`: not known here), the same list on every rank
    that learns it, a list with a failure on one that cannot. Either may raise
    when this rank cannot reach the others (the command then fails here).
    """

    rank: int
    size: int
    name: str

    def begin(self, timeout: float) -> int:
        """The round a command starting now takes part in."""
        ...

    def exchange(self, round: int, vote: bytes, timeout: float) -> list[bytes | None]:
        """Every rank's vote in ``round``."""
        ...


@dataclass(frozen=True)
class Vote:
    """One rank's vote on one collective command."""

    rank: int
    round: int
    command: str
    ok: bool
    reason: str = ""

    def encode(self) -> bytes:
        """Compact JSON of at most :data:`VOTE_BYTES` bytes (the reason is cut to fit)."""
        reason = self.reason
        while True:
            raw = json.dumps(
                {"r": self.rank, "n": self.round, "c": self.command, "ok": self.ok, "why": reason},
                separators=(",", ":"),
            ).encode()
            if len(raw) <= VOTE_BYTES:
                return raw
            reason = reason[: max(0, len(reason) - (len(raw) - VOTE_BYTES) - 16)] + "..."

    @classmethod
    def decode(cls, raw: bytes) -> Vote:
        """Inverse of :meth:`encode` (trailing zero bytes ignored)."""
        d = json.loads(raw.rstrip(b"\0").decode())
        return cls(int(d["r"]), int(d["n"]), str(d["c"]), bool(d["ok"]), str(d["why"]))


def decide(raw: list[bytes | None], timeout: float) -> dict[int, str]:
    """The failed ranks and why, from every rank's vote (the same answer on every rank for the same list).

    A commit (no failed rank) needs every rank's ok vote: an :data:`UNHEARD`
    rank in a list without another failure is itself the failure.
    """
    failed: dict[int, str] = {}
    votes: dict[int, Vote] = {}
    unheard = [rank for rank, item in enumerate(raw) if item == UNHEARD]
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
    if not failed:
        for rank in unheard:
            failed[rank] = "vote not known on this rank (it was never heard): no commit without every rank's ok"
    return dict(sorted(failed.items()))


#: What turns a group object of another library into an :class:`Agreement` (None: not one of its groups).
GroupAdapter = Callable[[object], "Agreement | None"]

_ADAPTERS: list[GroupAdapter] = []


def adapt_groups(adapter: GroupAdapter) -> None:
    """Hand :func:`as_agreement` a way to wrap foreign groups (the package ``torpor`` hands the torch one down)."""
    if adapter not in _ADAPTERS:
        _ADAPTERS.append(adapter)


def as_agreement(group: object) -> Agreement:
    """An :class:`Agreement` as given, or a ``torch.distributed`` process group wrapped in ``TorchGroup``."""
    if isinstance(group, Agreement):
        return group
    for adapter in _ADAPTERS:
        wrapped = adapter(group)
        if wrapped is not None:
            return wrapped
    msg = (
        f"group must be a torch.distributed ProcessGroup (gloo) or an object meeting torpor's Agreement "
        f"protocol (rank, size, name, begin, exchange), not {type(group).__name__}"
    )
    raise BadArgumentType(msg)


@dataclass
class _Txn:
    command: str
    round: int
    voted: bool = False
    lost: str = ""  # why this rank could not take part (the agreement could not start the round)


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
        self.timeout = check_timeout(timeout)
        self.agreement = agreement
        self.round = 0  # the round of the last command
        self._lock = threading.Lock()
        self._txn: _Txn | None = None
        self.last: Outcome | None = None

    def run(self, ctl: Participant, command: str, call: Callable[[], R]) -> R:
        """Run ``call()`` (the whole command) as the group's next command: vote, and commit or compensate with every rank."""
        if not self._lock.acquire(blocking=False):  # see docs/architecture.md "Invariant: one command at a time"
            running = self._txn.command if self._txn else "a group command"
            ctl.refuse(command, CommandInFlight(command, f"{running} (collective)", ctl.state.value))
        try:
            try:
                self.round = self.agreement.begin(self.timeout)
                txn = self._txn = _Txn(command, self.round)
            except Exception as exc:  # the group cannot be reached: take part in nothing, fail here
                txn = self._txn = _Txn(command, self.round + 1, lost=f"{type(exc).__name__}: {exc}")
                outcome = self._vote(ctl, txn, ok=False, reason=f"could not start the round ({txn.lost})")
                raise outcome.error() from exc
            try:
                result = call()
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
        vote = Vote(a.rank, txn.round, txn.command, ok, reason)
        start = time.perf_counter()
        try:
            if txn.lost:
                msg = txn.lost
                raise GroupLost(msg)
            raw = a.exchange(txn.round, vote.encode(), self.timeout)
        except Exception as exc:  # this rank cannot learn the outcome: a failure here, whatever the others do
            why = reason or f"lost the group ({type(exc).__name__}: {exc}); the outcome is not known here"
            raw = [
                Vote(a.rank, txn.round, txn.command, False, why).encode() if r == a.rank else UNHEARD
                for r in range(a.size)
            ]
        failed = decide(raw, self.timeout)
        self.round = txn.round = _round_of(raw, a.rank, txn.round)  # a void round is retried by the agreement
        outcome = Outcome(a.name, txn.command, txn.round, a.size, failed, time.perf_counter() - start)
        self.last = outcome
        ctl.record(
            GroupAgreed(
                group=outcome.group,
                command=outcome.command,
                round=outcome.round,
                size=outcome.size,
                result="commit" if outcome.ok else "rollback",
                failed={str(r): why[:512] for r, why in failed.items()},
                voted=ok,
                seconds=outcome.seconds,
            )
        )
        return outcome


def _round_of(raw: list[bytes | None], rank: int, asked: int) -> int:
    """The round this rank's vote was counted in (the one asked, unless the agreement moved it on)."""
    try:
        return Vote.decode(raw[rank] or b"").round
    except (ValueError, KeyError, TypeError, IndexError):
        return asked
