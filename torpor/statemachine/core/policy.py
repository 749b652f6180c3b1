"""The tag vocabulary and the sleep policy: which tag is offloaded and which discarded at each level, and how host memory is held.

Pure data, and the one place tags are named and judged: the allocator takes
what it needs from here as parameters (the controller passes them) and decides
nothing. The default follows vLLM: ``kv_cache`` and ``workspace`` (scratch
buffers, rewritten before every read) are discarded at both levels,
``weights`` at level 2; ``cudagraph`` is never discarded (graphs hold
write-once state); ``weights`` and ``kv_cache`` are the only deferrable tags (a
wake that does not name them leaves them asleep), and any wake restores every
other tag. :class:`HostMemoryPolicy` says when backups' host memory is pinned,
whether it is kept after a wake, and how many bytes it may take; the controller
applies it, the allocator only obeys.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torpor.errors import BadArgument, InvalidLevel
from torpor.switches import env_text


class Action(enum.StrEnum):
    """What sleep does to one tag."""

    OFFLOAD = "offload"
    DISCARD = "discard"


#: The tags torpor and its integrations name. Any other string is a tag too (offloaded by default).
WEIGHTS = "weights"
KV_CACHE = "kv_cache"
CUDAGRAPH = "cudagraph"  # the process's CUDA-graph pool (``capture``); never discarded
WORKSPACE = "workspace"  # scratch buffers, rewritten before every read
RUNTIME = "runtime"
DEFAULT_TAG = "default"  # what the allocator tags an allocation made outside any tag

DEFERRABLE: frozenset[str] = frozenset({WEIGHTS, KV_CACHE})
NEVER_DISCARD: frozenset[str] = frozenset({CUDAGRAPH})


class PinWhen(enum.StrEnum):
    """When host memory for backups is pinned."""

    AHEAD = "ahead"  # in the background as tagged memory grows: the first sleep copies at link speed
    AT_SLEEP = "at_sleep"  # by the sleep that needs it, pipelined with its copies


class AfterWake(enum.StrEnum):
    """What happens to pinned host memory once a wake copied the backups back."""

    KEEP = "keep"  # stays pinned for the next sleep (later sleeps at link speed)
    RELEASE = "release"  # given back (unpinned in the background): host memory is held only while asleep


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
#: The most bytes a budget may be: the largest integer the event log records and reads back (2**63-1).
MAX_BUDGET = 2**63 - 1


def parse_bytes(text: str) -> int:
    """``"64GiB"``, ``"64G"``, ``"1.5 TiB"``, ``"4096"`` -> bytes (binary units), exactly; over 2**63-1 is a ValueError."""
    match = re.fullmatch(r"\s*([0-9]+)(?:\.([0-9]+))?\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        msg = f"not a byte size: {text!r} (say 64GiB, 512MiB or a number of bytes)"
        raise BadArgument(msg)
    whole, fraction, unit = match.group(1).lstrip("0") or "0", (match.group(2) or "")[:24], _UNITS[match.group(3)]
    if len(whole) > 24:  # far over the limit: not converted (int() refuses past 4300 digits)
        msg = f"a byte size of {len(whole)} digits is over 2**63-1 (the most the event log records)"
        raise BadArgument(msg)
    scale: int = 10 ** len(fraction)
    nbytes = int(whole) * unit + int(fraction or "0") * unit // scale  # integers: no float rounding
    if nbytes > MAX_BUDGET:
        msg = f"{text.strip()!r} is {nbytes} bytes, over 2**63-1 (the most the event log records)"
        raise BadArgument(msg)
    return nbytes


@dataclass(frozen=True)
class HostMemoryPolicy:
    """How much host memory backups may pin, and when.

    ``pin``: :attr:`PinWhen.AT_SLEEP` (default) or :attr:`PinWhen.AHEAD`.
    ``after_wake``: :attr:`AfterWake.KEEP` (default) or :attr:`AfterWake.RELEASE`.
    ``budget_bytes``: the most pinned host bytes the backups of this engine rank
    may hold (None: no budget); a sleep whose backups would pass it is refused
    before anything is touched (``HostBudgetExceeded``), and pinning ahead stops
    at it. The measurements behind the default are in docs/benchmarks.md.
    """

    pin: PinWhen = PinWhen.AT_SLEEP
    after_wake: AfterWake = AfterWake.KEEP
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "pin", PinWhen(self.pin))
        object.__setattr__(self, "after_wake", AfterWake(self.after_wake))
        if self.budget_bytes is not None and (
            type(self.budget_bytes) is not int or not 0 <= self.budget_bytes <= MAX_BUDGET
        ):
            msg = f"budget_bytes must be a number of bytes in 0..2**63-1 (what the log records) or None, not {self.budget_bytes!r}"
            raise BadArgument(msg)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HostMemoryPolicy:
        """The policy ``TORPOR_HOST_PIN`` (ahead|at_sleep), ``TORPOR_HOST_AFTER_WAKE`` (keep|release) and ``TORPOR_HOST_BUDGET`` (64GiB) say; defaults otherwise."""
        pin = (env_text("TORPOR_HOST_PIN", environ) or "").strip() or PinWhen.AT_SLEEP.value
        after = (env_text("TORPOR_HOST_AFTER_WAKE", environ) or "").strip() or AfterWake.KEEP.value
        budget = (env_text("TORPOR_HOST_BUDGET", environ) or "").strip()
        try:
            return cls(PinWhen(pin), AfterWake(after), parse_bytes(budget) if budget else None)
        except ValueError as exc:
            msg = (
                f"bad host-memory settings (TORPOR_HOST_PIN={pin!r}, TORPOR_HOST_AFTER_WAKE={after!r}, "
                f"TORPOR_HOST_BUDGET={budget!r}): {exc}; pin is ahead|at_sleep, after-wake keep|release"
            )
            raise BadArgument(msg) from exc

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (recorded in the ``opened`` event)."""
        return {"pin": self.pin.value, "after_wake": self.after_wake.value, "budget_bytes": self.budget_bytes}


@dataclass(frozen=True)
class Policy:
    """Per-level actions for named tags; any other tag is offloaded.

    ``levels[level][tag]`` is the action for ``tag`` at ``level``. Tags in
    ``deferrable`` are restored only by a wake that names them. ``host``: the
    host-memory policy (None: from the ``TORPOR_HOST_*`` environment when a
    controller starts).

    ``discard_first``: a sleep releases its discarded tags before it backs up the
    others, for engines whose discarded content is already forgotten when they
    sleep (vLLM clears its prefix cache first; its facade sets this). The
    driver's work on the freed memory then runs under the backup's copies
    instead of under a wake that comes at once (docs/benchmarks.md, the 8B
    section). The cost: a sleep that fails after the discard wakes with fresh
    memory in those tags, named in ``sleep_aborted``'s ``lost``; offloaded
    content is never lost. Ignored with a group, whose ranks vote before anything
    is discarded. Default off: every other failed sleep loses nothing.
    """

    levels: Mapping[int, Mapping[str, Action]] = field(
        default_factory=lambda: {
            1: {WEIGHTS: Action.OFFLOAD, KV_CACHE: Action.DISCARD, WORKSPACE: Action.DISCARD},
            2: {WEIGHTS: Action.DISCARD, KV_CACHE: Action.DISCARD, WORKSPACE: Action.DISCARD},
        }
    )
    deferrable: frozenset[str] = DEFERRABLE
    host: HostMemoryPolicy | None = None
    discard_first: bool = False

    def host_policy(self) -> HostMemoryPolicy:
        """``host``, or when None the ``TORPOR_HOST_*`` environment's (read now; ValueError when malformed)."""
        return self.host if self.host is not None else HostMemoryPolicy.from_env()

    def __post_init__(self) -> None:
        for level, actions in self.levels.items():
            for tag in NEVER_DISCARD:
                if actions.get(tag) is Action.DISCARD:
                    msg = (
                        f"policy discards {tag!r} at level {level}: graphs hold write-once state, it must be offloaded"
                    )
                    raise BadArgument(msg)

    def plan(self, level: int, tags: Iterable[str]) -> dict[str, Action]:
        """Return ``{tag: action}`` for sleeping ``tags`` at ``level``."""
        if level not in self.levels:
            raise InvalidLevel(level)
        actions = self.levels[level]
        return {tag: actions.get(tag, Action.OFFLOAD) for tag in sorted(tags)}

    def never_backed_up(self) -> frozenset[str]:
        """Tags discarded at every level: no sleep copies them, so pinning host memory ahead for them is waste."""
        if not self.levels:
            return frozenset()
        named = set.intersection(*(set(actions) for actions in self.levels.values()))
        return frozenset(t for t in named if all(a[t] == Action.DISCARD for a in self.levels.values()))

    def wake_set(self, requested: Iterable[str] | None, asleep: Iterable[str]) -> list[str]:
        """Tags a wake restores: every asleep tag, less unrequested deferrable ones."""
        asleep = sorted(asleep)
        if requested is None:
            return asleep
        wanted = set(requested)
        return [t for t in asleep if t in wanted or t not in self.deferrable]


DEFAULT_POLICY = Policy()
