"""``TorchGroup``: torpor's group agreement for a ``torch.distributed`` process group.

The votes of a collective command travel through the group's rendezvous
store (the c10d ``TCPStore`` every ``init_process_group`` sets up), in a
star, one round per command under ``torpor/<name>/<round>/``:

- ``begin``: a command takes the round after ``last`` (the highest decided
  round), skipping any round whose outcome is already there and any this
  member used, so an uneven command, a reopened controller or keys an earlier
  run left in a long-lived store cannot make a rank read an old round;
- every rank but 0 sets its vote ``v<rank>``; rank 0 marks the round
  ``open``, waits for the votes (up to the timeout) and sets the outcome
  ``d`` with ``compare_set``: the first outcome written is the only one;
- a rank that sees no outcome within twice the timeout (rank 0 may come up
  to one timeout late, then waits one for the others) writes one itself, a
  rollback naming rank 0, with the same ``compare_set``: whichever came
  first is what every rank reads, so no rank can commit while another rolls
  back for want of an answer;
- a round rank 0 finds ``open`` but undecided when it opens it was left by
  an earlier run: it is declared void and every rank votes again in the next.

A store call that fails is retried (the connection may come back) until the
rank's deadline; a rank that still cannot learn the outcome fails the
command here (it rolls back and raises ``GroupFailed``). Nothing compares
wall clocks across hosts.

Why the store and not a collective of the group itself: a gloo wait that
times out closes every connection of the group on that rank (gloo's
``Application timeout caused pair closure``, measured with torch 2.14), so
the group would be dead after the first slow rank; an NCCL collective needs
device memory, which is asleep or full exactly when a wake fails, and NCCL's
watchdog tears the process down on a timeout instead of raising. A store wait
that times out raises and leaves the store and the group usable. So any
process group works (gloo, nccl, a ``new_group`` subgroup): torpor takes
only its membership from it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from torpor.errors import GroupUnsupported
from torpor.statemachine.machine.group import UNHEARD, Vote

#: A rank waits this many timeouts for the round's outcome: rank 0 may arrive up to one timeout later and then
#: wait one timeout for the others.
LIST_WAIT = 2.0
#: Rounds whose keys rank 0 keeps in the store (older ones are deleted).
KEEP_ROUNDS = 16
#: Seconds between two tries of a store call that failed.
RETRY_PAUSE = 0.05
#: The outcome of a round an earlier run left open: nobody's vote counts, every rank votes again in the next.
VOID = "void"

logger = logging.getLogger("torpor.group")
T = TypeVar("T")


class TorchGroup:
    """An ``Agreement`` (see :mod:`torpor.statemachine.machine.group`) for a ``torch.distributed`` process group.

    ``group`` defaults to the default (world) group; ``store`` to the default
    group's rendezvous store; ``name`` to ``pg:`` and the group's global
    ranks. Build it on every rank of the group; building it again (a
    reopened controller) joins the group's next round.
    """

    def __init__(self, group: Any = None, *, store: Any = None, name: str | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            msg = "torch.distributed is not initialized: call init_process_group before giving a group to torpor"
            raise GroupUnsupported(msg)
        pg: Any = group if group is not None else dist.group.WORLD
        if pg is None or pg.rank() < 0:
            msg = "this process is not a member of the group given to torpor"
            raise GroupUnsupported(msg)
        self.rank = int(pg.rank())
        self.size = int(pg.size())
        ranks = dist.get_process_group_ranks(pg)
        self.name = name or f"pg:{','.join(str(r) for r in ranks)}"
        self._store: Any = store if store is not None else dist.distributed_c10d._get_default_store()
        self._used = 0  # the last round this member took part in
        self._unreachable: Exception | None = None  # why ``begin`` could not read the store

    def _key(self, round: int, what: str) -> str:
        return f"torpor/{self.name}/{round}/{what}"

    @property
    def _last(self) -> str:
        return f"torpor/{self.name}/last"

    def _retry(self, call: Callable[[], T], deadline: float) -> T:
        """``call()``, tried again after a store error until ``deadline`` (then the last error is raised)."""
        while True:
            try:
                return call()
            except (RuntimeError, ValueError):  # DistNetworkError, DistStoreError: the connection may come back
                if time.monotonic() + RETRY_PAUSE >= deadline:
                    raise
                time.sleep(RETRY_PAUSE)

    def begin(self, timeout: float) -> int:
        """The round after the highest decided one (and after this member's last): never a decided round."""
        deadline = time.monotonic() + timeout
        if self.size == 1:
            self._used += 1
            return self._used
        try:
            last = int(self._retry(lambda: self._store.add(self._last, 0), deadline))
            round = max(last, self._used) + 1
            while self._retry(functools.partial(self._has, self._key(round, "d")), deadline):
                round += 1  # decided while ``last`` lagged behind (its writer was cut off before raising it)
        except (RuntimeError, ValueError) as exc:  # the store is out of reach: this round's exchange fails at once
            self._unreachable = exc
            round = self._used + 1
        self._used = round
        return round

    def exchange(self, round: int, vote: bytes, timeout: float) -> list[bytes | None]:
        """The outcome of ``round`` as every rank's vote (None: not seen within ``timeout``; ``UNHEARD``: not known)."""
        if self.size == 1:
            return [vote]
        deadline = time.monotonic() + timeout * LIST_WAIT
        while True:
            if self._unreachable is not None:
                exc, self._unreachable = self._unreachable, None
                return self._lost(round, vote, exc)
            try:
                if self.rank == 0:
                    outcome = self._coordinate(round, vote, timeout, deadline)
                else:
                    outcome = self._follow(round, vote, timeout, deadline)
            except (RuntimeError, ValueError) as exc:  # the store stayed out of reach: the outcome is not known here
                return self._lost(round, vote, exc)
            if outcome is not None:
                return outcome
            round = self.begin(max(deadline - time.monotonic(), RETRY_PAUSE))  # a void round: vote in the next
            vote = dataclasses.replace(Vote.decode(vote), round=round).encode()

    def _lost(self, round: int, vote: bytes, exc: Exception) -> list[bytes | None]:
        """The store stayed out of reach: a failure here, naming rank 0 (its host under ``tcp://``) or this rank."""
        why = f"the group's store did not answer rank {self.rank} in round #{round} ({type(exc).__name__}: {exc})"
        mine = Vote.decode(vote)
        out: list[bytes | None] = [UNHEARD] * self.size
        out[self.rank] = vote
        out[0] = dataclasses.replace(mine, rank=0, ok=False, reason=f"{why}: no outcome known there").encode()
        return out

    def _coordinate(self, round: int, vote: bytes, timeout: float, deadline: float) -> list[bytes | None] | None:
        store = self._store
        token = secrets.token_hex(8)
        decided = self._key(round, "d")
        opened = bytes(self._retry(lambda: store.compare_set(self._key(round, "open"), "", token), deadline))
        if self._retry(functools.partial(self._has, decided), deadline):  # decided without rank 0 (it came too late)
            return self._read(decided, deadline)
        if opened.decode(errors="replace") != token:  # left open and undecided by an earlier run
            logger.warning("torpor: group %s: round #%d was left open by an earlier run: void", self.name, round)
            return self._decide(round, {VOID: f"round #{round} was left open by an earlier run"}, deadline)
        keys = {r: self._key(round, f"v{r}") for r in range(1, self.size)}
        present = list(keys)
        if not self._wait(list(keys.values()), min(time.monotonic() + timeout, deadline)):  # who is missing?
            present = [r for r in keys if self._retry(functools.partial(self._has, keys[r]), deadline)]
        values = self._retry(lambda: self._get([keys[r] for r in present]), deadline)
        got = dict(zip(present, values, strict=True))
        out = [vote] + [bytes(got[r]) if r in got else None for r in range(1, self.size)]
        return self._decide(round, [None if v is None else v.decode() for v in out], deadline)

    def _follow(self, round: int, vote: bytes, timeout: float, deadline: float) -> list[bytes | None] | None:
        store = self._store
        decided = self._key(round, "d")
        waited = deadline - min(timeout / 4, 0.5)  # the rest is left to write a rollback, should none be there
        self._retry(lambda: store.set(self._key(round, f"v{self.rank}"), vote), waited)
        if self._wait([decided], waited) or self._retry(functools.partial(self._has, decided), deadline):
            return self._read(decided, deadline)
        mine = Vote.decode(vote)
        why = f"no outcome from rank 0 within {timeout * LIST_WAIT:g} s (it died, hangs, or lost the store)"
        silent = Vote(0, round, mine.command, False, why).encode().decode()
        entries = [silent] + ["" for _ in range(1, self.size)]
        entries[self.rank] = vote.decode()
        return self._decide(round, entries, deadline)

    def _decide(self, round: int, outcome: object, deadline: float) -> list[bytes | None] | None:
        """Write ``outcome`` unless one is there already; what is there (ours or the first) is the round's."""
        store = self._store
        raw = json.dumps(outcome, separators=(",", ":"))
        written = bytes(self._retry(lambda: store.compare_set(self._key(round, "d"), "", raw), deadline))
        if written.decode() == raw:
            try:  # best effort: ``begin`` skips a decided round even when ``last`` lags
                self._raise_last(round)
                if self.rank == 0 and round > KEEP_ROUNDS:
                    old = round - KEEP_ROUNDS
                    for what in ["open", "d", *(f"v{r}" for r in range(1, self.size))]:
                        store.delete_key(self._key(old, what))
            except (RuntimeError, ValueError) as exc:
                logger.info("torpor: group %s: round #%d decided; store upkeep failed: %s", self.name, round, exc)
        return _outcome(written)

    def _read(self, key: str, deadline: float) -> list[bytes | None] | None:
        return _outcome(bytes(self._retry(lambda: self._store.get(key), deadline)))

    def _raise_last(self, round: int) -> None:
        """Set ``last`` to ``round`` unless it is higher already (a compare-and-set loop: it never goes down)."""
        current = int(self._store.add(self._last, 0))
        while current < round:
            current = int(bytes(self._store.compare_set(self._last, str(current), str(round))).decode())

    def _wait(self, keys: list[str], until: float) -> bool:
        """True once every key is there; False at ``until`` (a store error before then is retried)."""
        while (left := until - time.monotonic()) > 0:
            try:
                self._store.wait(keys, datetime.timedelta(seconds=left))
                return True
            except (RuntimeError, ValueError):
                time.sleep(min(RETRY_PAUSE, max(until - time.monotonic(), 0)))
        return False

    def _has(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def _get(self, keys: list[str]) -> list[bytes]:
        if not keys:
            return []
        multi_get = getattr(self._store, "multi_get", None)  # one round trip where torch has it (2.5+)
        return list(multi_get(keys)) if multi_get is not None else [self._store.get(k) for k in keys]


def _outcome(raw: bytes) -> list[bytes | None] | None:
    """A stored outcome as every rank's vote; None for a void round."""
    parsed = json.loads(raw.decode())
    if isinstance(parsed, dict):
        return None
    return [None if v is None else v.encode() for v in parsed]
