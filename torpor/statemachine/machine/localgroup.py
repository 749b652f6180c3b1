"""A group whose ranks are threads of one process: the :class:`~torpor.statemachine.machine.group.Agreement` of tests and examples.

Each member posts its vote for a round in memory shared by the group and waits
for the others (or the timeout); the first member to time out fixes the round's
list for every rank, as a group of processes would see a dead rank.
"""

from __future__ import annotations

import threading
import time


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
        self._used = 0  # the last round this member took part in

    @classmethod
    def make(cls, size: int, name: str = "local") -> list[LocalGroup]:
        """One member per rank of a new group."""
        shared = _LocalShared(size, name)
        return [cls(shared, r) for r in range(size)]

    def begin(self, timeout: float) -> int:
        """The first round not decided yet (and not used by this member): a decided round is never joined late."""
        s = self._shared
        with s.cond:
            round = max(s.last, self._used) + 1
            while round in s.final:
                round += 1
            self._used = round
            return round

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
                    s.last = max(s.last, round)
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
        self.last = 0  # the highest decided round
