"""The controller's refusals and failures: a command the state does not allow, a tag or level it does not know, a group that failed, a budget passed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torpor.errors.base import TorporError

__all__ = [
    "CommandInFlight",
    "ControllerClosed",
    "GroupFailed",
    "GroupLost",
    "GroupUnsupported",
    "HostBudgetExceeded",
    "InvalidLevel",
    "InvalidTransition",
    "NoTagsNamed",
    "NotRecovered",
    "NotReloaded",
    "PoolBusy",
    "TableContradiction",
    "TrackRefused",
    "UnknownTag",
]


class InvalidTransition(TorporError, RuntimeError):
    """A command the current state does not allow: ``command``, ``state``, ``since`` (event #), ``allowed`` states."""

    def __init__(
        self,
        command: str,
        state: str,
        since: int,
        allowed: Iterable[str],
        detail: str = "",
        since_wall: str = "",
    ) -> None:
        self.command = command
        self.state = state
        self.since = since
        self.allowed = tuple(allowed)
        self.detail = detail
        at = f" at {since_wall}" if since_wall else ""
        allowed_txt = ", ".join(self.allowed) if self.allowed else "nowhere"
        extra = f"; {detail}" if detail else ""
        msg = f"cannot {command} from {state!r} (event #{since}{at}); allowed from: {allowed_txt}{extra}"
        super().__init__(msg)


class CommandInFlight(TorporError, RuntimeError):
    """A command arrived while another command held the controller."""

    def __init__(self, command: str, in_flight: str, state: str) -> None:
        self.command = command
        self.in_flight = in_flight
        self.state = state
        msg = f"cannot {command}: {in_flight!r} is in flight (state {state!r}); retry when it ends"
        super().__init__(msg)


class PoolBusy(TorporError, RuntimeError):
    """The graph pool cannot be released: ``holders`` names each (a live graph and its site, or other references)."""

    def __init__(self, reason: str, holders: Sequence[str] = ()) -> None:
        self.reason = reason
        self.holders = tuple(holders)
        super().__init__(reason)


class UnknownTag(TorporError, ValueError):
    """A tag that the memory does not hold."""

    def __init__(self, tags: Iterable[str], known: Iterable[str]) -> None:
        self.tags = tuple(tags)
        self.known = tuple(sorted(known))
        msg = f"unknown tag(s) {', '.join(repr(t) for t in self.tags)}; known tags: {', '.join(self.known) or 'none'}"
        super().__init__(msg)


class NoTagsNamed(TorporError, ValueError):
    """``tags=[]`` names no tag (``None`` names every tag): refused, naming the state and the asleep tags."""

    def __init__(self, command: str, state: str, since: int, asleep: Sequence[str]) -> None:
        self.command, self.state, self.since, self.asleep = command, state, since, tuple(asleep)
        held = f"; asleep: {', '.join(asleep)}" if asleep else ""
        msg = f"cannot {command} tags=[]: it names no tag (state {state!r} since event #{since}{held}); "
        super().__init__(f"{msg}name the tags to {command}, or pass None for all")


class InvalidLevel(TorporError, ValueError):
    """A sleep level other than 1 or 2."""

    def __init__(self, level: object) -> None:
        self.level = level
        super().__init__(f"sleep level must be 1 or 2, got {level!r}")


class NotRecovered(TorporError, RuntimeError):
    """The log ends inside a transition: the engine is not in a clean state."""

    def __init__(self, state: str, last_seq: int, step: str, cause: str = "") -> None:
        self.state = state
        self.last_seq = last_seq
        self.step = step
        self.cause = cause
        if cause:  # this process: the log could not record a rollback
            super().__init__(
                f"the event log ends in {state!r} at event #{last_seq} ({step}): {cause}; once the log can be "
                "written again, call controller.recover(), which takes each tag's residency from the memory"
            )
            return
        super().__init__(
            f"the event log ends in {state!r} at event #{last_seq} ({step}): the process "
            "was interrupted mid-transition and memory may be partly released; call "
            "controller.recover() after restarting the engine, or start a new log"
        )


class ControllerClosed(TorporError, RuntimeError):
    """A command or record on a controller that was closed."""

    def __init__(self, command: str, engine: str, rank: int, closed_at: int) -> None:
        self.command = command
        self.engine = engine
        self.rank = rank
        self.closed_at = closed_at
        super().__init__(
            f"cannot {command}: the controller of engine {engine!r} rank {rank} was closed at event #{closed_at}; "
            "open a new SleepController on its log to continue"
        )


class GroupFailed(TorporError, RuntimeError):
    """A collective command failed on some rank, so every rank undid its part (raised on every rank alike).

    ``ranks``: each failed rank -> why; ``command``, ``group``, ``round`` (its command number), ``size``.
    """

    def __init__(self, command: str, group: str, round: int, size: int, ranks: dict[int, str]) -> None:
        self.command = command
        self.group = group
        self.round = round
        self.size = size
        self.ranks = dict(sorted(ranks.items()))
        which = ", ".join(str(r) for r in self.ranks)
        why = "; ".join(f"rank {r}: {reason}" for r, reason in self.ranks.items())
        super().__init__(
            f"{command} failed on rank {which} of group {group!r} ({size} ranks, command #{round}), so every "
            f"rank rolled back to its state before the command ({why}); fix the cause and retry on every rank"
        )


class GroupUnsupported(TorporError, ValueError):
    """A process group torpor cannot agree over (torch.distributed not initialized, or this process not in it)."""


class HostBudgetExceeded(TorporError, RuntimeError):
    """A sleep whose backups would pin more host memory than the host-memory budget allows (nothing was touched).

    ``needed`` (per tag in ``offloading``), ``budget``, ``held`` (by tags asleep already), ``holders`` (``tag: bytes``).
    """

    def __init__(self, command: str, state: str, offloading: dict[str, int], held: dict[str, int], budget: int) -> None:
        self.command = command
        self.state = state
        self.offloading = dict(offloading)
        self.needed = sum(offloading.values())
        self.held = sum(held.values())
        self.budget = budget
        self.holders = [f"backup of {t} (asleep): {n} bytes" for t, n in sorted(held.items())] + [
            f"{t} to offload: {n} bytes" for t, n in sorted(offloading.items())
        ]
        asleep = ", ".join(f"{t} {n} B" for t, n in sorted(held.items())) or "none"
        wanted = ", ".join(f"{t} {n} B" for t, n in sorted(offloading.items()))
        msg = (
            f"cannot {command} from {state!r}: its backups need {self.needed} bytes of pinned host memory "
            f"({wanted}) and backups already hold {self.held} ({asleep}); the host budget is {budget} bytes. "
            "Nothing was released. Raise the budget (HostMemoryPolicy.budget_bytes, TORPOR_HOST_BUDGET), "
            "sleep at level 2 (discards weights), or wake the asleep tags first"
        )
        super().__init__(msg)


class NotReloaded(TorporError, RuntimeError):
    """Tracked tensors that no reload wrote after a wake without a backup; ``names`` lists them."""

    def __init__(self, tag: str, names: list[str]) -> None:
        self.tag = tag
        self.names = list(names)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        msg = (
            f"{len(names)} tracked tensor(s) of tag {tag!r} were not written since the wake that discarded them: "
            f"{shown}; their memory holds 0xFF filler, not weights: load them (load_state_dict(..., strict=True)) "
            "before the next forward"
        )
        super().__init__(msg)


class TrackRefused(TorporError, ValueError):
    """``track`` refused: the memory cannot keep ranges, or the policy never discards the tag."""


class GroupLost(TorporError, RuntimeError):
    """A collective round that lost a peer or its agreement (the reason it names); every rank undoes its part."""


class TableContradiction(TorporError, ValueError):
    """The transition table contradicts itself (a refusal for a cell its rows accept): found when the guard is built."""
