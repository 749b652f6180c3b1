"""What the demo drives: a workload on one device (GPU or simulated) with tagged memory it can check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from torpor.statemachine import Memory, SleepController

#: The tags the demo puts memory under, in the order tables list them.
DEMO_TAGS: tuple[str, ...] = ("weights", "kv_cache", "cudagraph", "runtime")

#: Batch sizes a graph is captured for (one graph each, all in the cudagraph pool).
BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Check:
    """The result of comparing the workload with its first awake run.

    ``per_tag`` says, for each tag that was checked, ``exact``, ``refilled``
    (discarded, recomputed, then equal), ``reloaded`` (weights discarded at
    level 2, loaded again, then equal) or ``DIFFERS``.
    """

    exact: bool
    what: str
    per_tag: Mapping[str, str] = field(default_factory=dict)


class Workload(Protocol):
    """A model-like workload whose memory the controller puts to sleep and wakes."""

    device: str
    """``cuda`` or ``sim``."""

    untagged: str
    """What the device memory outside torpor's tags is, as the asleep line names it."""

    def describe(self) -> list[str]:
        """Lines saying what runs where (device, model, sizes, scaling)."""
        ...

    @property
    def memory(self) -> Memory:
        """The memory the controller drives (the tagged allocator)."""
        ...

    def setup(self, controller: SleepController) -> None:
        """Allocate and fill every tag, capture the graphs (through ``controller.capture``), run once."""
        ...

    def prepare(self, woken: Sequence[str], reload_weights: bool) -> None:
        """After a wake: recompute ``kv_cache`` (prefill) if it woke; reload weights when asked."""
        ...

    def check(self, tags: Sequence[str], refilled: Sequence[str], reloaded: Sequence[str]) -> Check:
        """Compare what is resident now (``tags``) with the first awake run."""
        ...

    def drop_graphs(self) -> None:
        """Drop every captured graph (and what it holds), so the graph pool can be released."""
        ...

    def close(self) -> None:
        """Free what the workload allocated."""
        ...
