"""``TorchGroup``: torpor's group agreement for a ``torch.distributed`` process group.

The votes of a collective command travel through the group's rendezvous
store (the c10d ``TCPStore`` every ``init_process_group`` sets up), in a
star: every rank sets its vote under a key of the command, the group's rank 0
waits for all of them (up to the timeout) and sets the full list, which
every rank reads. So every rank decides on the same list; rank 0 names
exactly the ranks whose vote it did not see; a rank that sees no list within
twice the timeout (rank 0 may come up to one timeout late, then waits one for
the others) names rank 0, and a rank that comes back late reads the list
that names it and rolls back too.

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

import datetime
import json
import time
from typing import Any

import torch.distributed as dist

from torpor.errors import (
    GroupUnsupported,
)
from torpor.statemachine.group import UNHEARD, Vote

#: A rank waits this many timeouts for rank 0's list: rank 0 may arrive up to one timeout later and then
#: wait one timeout for the others.
LIST_WAIT = 2.0
#: A vote older than this many timeouts when rank 0 sets the list: its rank is about to give up waiting.
STALE_AFTER = 1.5
#: Rounds whose keys rank 0 keeps in the store (older ones are deleted).
KEEP_ROUNDS = 2


class TorchGroup:
    """An ``Agreement`` (see :mod:`torpor.statemachine.group`) for a ``torch.distributed`` process group.

    ``group`` defaults to the default (world) group; ``store`` to the default
    group's rendezvous store; ``name`` to ``pg:`` and the group's global
    ranks. Build it on every rank of the group alike (the same number of
    times: each build is a new incarnation whose keys do not mix with older ones).
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
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        self._store: Any = store
        # every rank adds 1 once per build: the same incarnation number on every rank of this build
        self.incarnation = (int(store.add(f"torpor/{self.name}/builds", 1)) - 1) // self.size

    def _key(self, round: int, what: str) -> str:
        return f"torpor/{self.name}/{self.incarnation}/{round}/{what}"

    def exchange(self, round: int, vote: bytes, timeout: float) -> list[bytes | None]:
        """Every rank's vote for ``round`` (None: not seen within ``timeout``; ``UNHEARD``: rank 0 was not)."""
        if self.size == 1:
            return [vote]
        store = self._store
        try:
            store.set(self._key(round, f"v{self.rank}"), vote)
            if self.rank == 0:
                return self._coordinate(round, timeout)
            listed = self._key(round, "list")
            store.wait([listed], datetime.timedelta(seconds=timeout * LIST_WAIT))
            raw = json.loads(bytes(store.get(listed)).decode())
        except (RuntimeError, ValueError):  # DistStoreError (timeout), DistNetworkError (the store is gone)
            return self._without_coordinator(vote)
        return [None if v is None else v.encode() for v in raw]

    def _coordinate(self, round: int, timeout: float) -> list[bytes | None]:
        store = self._store
        keys = [self._key(round, f"v{r}") for r in range(self.size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=timeout))
            present = list(range(self.size))
        except RuntimeError:  # a timeout: which ranks are missing?
            present = [r for r in range(self.size) if store.check([keys[r]])]
        wanted = [keys[r] for r in present]
        multi_get = getattr(store, "multi_get", None)  # one round trip where torch has it (2.5+)
        values = multi_get(wanted) if multi_get is not None else [store.get(k) for k in wanted]
        got = dict(zip(present, values, strict=True))
        out: list[bytes | None] = []
        for r in range(self.size):
            raw = bytes(got[r]) if r in got else None
            if raw is not None and r != 0 and _age(raw) > timeout * STALE_AFTER:
                raw = None  # seen too late: that rank has given up (or will before it reads the list)
            out.append(raw)
        store.set(self._key(round, "list"), json.dumps([None if v is None else v.decode() for v in out]))
        old = round - KEEP_ROUNDS
        if old > 0:
            for what in [f"v{r}" for r in range(self.size)] + ["list"]:
                store.delete_key(self._key(old, what))
        return out

    def _without_coordinator(self, vote: bytes) -> list[bytes | None]:
        """Rank 0 did not answer: it failed; the others' votes are unknown (they fail the same way)."""
        return [vote if r == self.rank else None if r == 0 else UNHEARD for r in range(self.size)]


def _age(raw: bytes) -> float:
    """Seconds since a vote was cast (by its wall clock stamp; 0 when unreadable)."""
    try:
        return time.time() - Vote.decode(raw).wall
    except (ValueError, KeyError, TypeError):
        return 0.0
