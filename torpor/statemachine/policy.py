"""Sleep policy: which tag is offloaded and which discarded at each level.

Pure data. The default is the seed's: ``cudagraph`` is never discarded (graphs
hold write-once state), ``weights`` and ``kv_cache`` are the only deferrable
tags (a wake that does not name them leaves them asleep), and any wake restores
every other tag.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from torpor.errors import InvalidLevel


class Action(enum.StrEnum):
    """What sleep does to one tag."""

    OFFLOAD = "offload"
    DISCARD = "discard"


DEFERRABLE: frozenset[str] = frozenset({"weights", "kv_cache"})
NEVER_DISCARD: frozenset[str] = frozenset({"cudagraph"})


@dataclass(frozen=True)
class Policy:
    """Per-level actions for named tags; any other tag is offloaded.

    ``levels[level][tag]`` is the action for ``tag`` at ``level``. Tags in
    ``deferrable`` are restored only by a wake that names them.
    """

    levels: Mapping[int, Mapping[str, Action]] = field(
        default_factory=lambda: {
            1: {"weights": Action.OFFLOAD, "kv_cache": Action.DISCARD},
            2: {"weights": Action.DISCARD, "kv_cache": Action.DISCARD},
        }
    )
    deferrable: frozenset[str] = DEFERRABLE

    def __post_init__(self) -> None:
        for level, actions in self.levels.items():
            for tag in NEVER_DISCARD:
                if actions.get(tag) is Action.DISCARD:
                    msg = (
                        f"policy discards {tag!r} at level {level}: graphs hold write-once state, it must be offloaded"
                    )
                    raise ValueError(msg)

    def plan(self, level: int, tags: Iterable[str]) -> dict[str, Action]:
        """Return ``{tag: action}`` for sleeping ``tags`` at ``level``."""
        if level not in self.levels:
            raise InvalidLevel(level)
        actions = self.levels[level]
        return {tag: actions.get(tag, Action.OFFLOAD) for tag in sorted(tags)}

    def wake_set(self, requested: Iterable[str] | None, asleep: Iterable[str]) -> list[str]:
        """Tags a wake restores: every asleep tag, less unrequested deferrable ones."""
        asleep = sorted(asleep)
        if requested is None:
            return asleep
        wanted = set(requested)
        return [t for t in asleep if t in wanted or t not in self.deferrable]


DEFAULT_POLICY = Policy()
