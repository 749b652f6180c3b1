"""Test helpers users need too: an in-memory ``FakeMemory`` and ``capture_events``.

``FakeMemory`` meets the memory protocol without a GPU or real allocations:
each tag holds a content token that sleep backs up and wake restores, so a test
can check that nothing was lost; failures can be injected per operation and tag.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from torpor.errors import MemoryOperationFailed, PoolBusy
from torpor.statemachine.core.events import Event, EventKind
from torpor.statemachine.core.policy import CUDAGRAPH
from torpor.statemachine.core.protocol import Capability, TagUsage, Transfer
from torpor.statemachine.machine.controller import SleepController

_tokens = itertools.count(1)


@dataclass
class _Tag:
    size: int
    content: int | None = field(default_factory=lambda: next(_tokens))
    backup: int | None = None
    resident: bool = True


class FakeMemory:
    """The memory protocol in plain Python memory.

    ``tags`` maps tag -> bytes. ``failures`` is an iterable of
    ``(operation, tag)`` pairs (operation: backup, release, restore,
    drop_backup, capture, release_pool); each fails once when first reached.
    Beyond the memory protocol it owns a graph pool (its one capability).
    """

    @classmethod
    def capabilities(cls) -> frozenset[Capability]:
        """What this memory can do beyond the protocol: the cudagraph pool (capture, release_cudagraph_pool)."""
        return frozenset({Capability.GRAPH_POOL})

    def __init__(self, tags: Mapping[str, int], failures: Iterable[tuple[str, str]] = ()) -> None:
        self._tags = {tag: _Tag(size) for tag, size in tags.items()}
        self._failures: Counter[tuple[str, str]] = Counter(failures)
        self.pool: str | None = None
        self._pool_ids = itertools.count(1)
        self.graphs: list[str] = []
        self.other_references = 0
        self.calls: list[tuple[str, str]] = []

    # -- test controls ----------------------------------------------------------

    def fail_once(self, operation: str, tag: str = "*") -> None:
        """Make the next ``operation`` on ``tag`` (``*``: any tag) fail."""
        self._failures[(operation, tag)] += 1

    def write(self, tag: str) -> int:
        """Change a resident tag's content (as the engine would); return the new token."""
        entry = self._tags[tag]
        if not entry.resident:
            msg = f"write to {tag!r} while it is released"
            raise MemoryOperationFailed("write", tag, msg)
        entry.content = next(_tokens)
        return entry.content

    def content(self, tag: str) -> int | None:
        """The tag's current content token (None while released)."""
        return self._tags[tag].content if self._tags[tag].resident else None

    def drop_graph(self, site: str) -> None:
        """Forget the graph captured at ``site`` (as deleting a CUDAGraph would)."""
        self.graphs.remove(site)

    def _maybe_fail(self, operation: str, tag: str) -> None:
        self.calls.append((operation, tag))
        for key in ((operation, tag), (operation, "*")):
            if self._failures[key] > 0:
                self._failures[key] -= 1
                raise MemoryOperationFailed(operation, tag, "injected failure", call=f"FakeMemory.{operation}")

    # -- the memory protocol ------------------------------------------------------

    def usage(self) -> dict[str, TagUsage]:
        """Bytes per tag: resident, or on the host, or discarded."""
        out = {}
        for tag, e in self._tags.items():
            if e.resident:
                out[tag] = TagUsage(e.size, 0, 0, 1)
            elif e.backup is not None:
                out[tag] = TagUsage(0, e.size, 0, 1)
            else:
                out[tag] = TagUsage(0, 0, e.size, 1)
        return out

    def backup(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Copy each tag's content token to the 'host'; all or nothing."""
        done: dict[str, Transfer] = {}
        try:
            for tag in tags:
                self._maybe_fail("backup", tag)
                entry = self._tags[tag]
                entry.backup = entry.content
                done[tag] = Transfer(tag, entry.size, 0.0, offloaded=True)
        except MemoryOperationFailed:
            for tag in done:
                self._tags[tag].backup = None
            raise
        return done

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Release each tag; a tag without a backup loses its content."""
        done = {}
        for tag in tags:
            self._maybe_fail("release", tag)
            entry = self._tags[tag]
            entry.resident = False
            done[tag] = Transfer(tag, entry.size, 0.0, offloaded=entry.backup is not None)
        return done

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """Map each tag back; content from the backup, or fresh; all or nothing."""
        done: dict[str, Transfer] = {}
        try:
            for tag in tags:
                self._maybe_fail("restore", tag)
                entry = self._tags[tag]
                entry.resident = True
                entry.content = entry.backup if entry.backup is not None else next(_tokens)
                done[tag] = Transfer(tag, entry.size, 0.0, offloaded=entry.backup is not None)
        except MemoryOperationFailed:
            for tag in done:
                self._tags[tag].resident = False
            raise
        return done

    def drop_backup(self, tags: Sequence[str]) -> None:
        """Forget backups (after a wake, an aborted sleep, or a discard while asleep)."""
        for tag in tags:
            self._maybe_fail("drop_backup", tag)
            self._tags[tag].backup = None

    # -- the graph pool -------------------------------------------------------------

    def cudagraph_pool_holders(self) -> list[str]:
        """Live graphs by capture site, plus other references."""
        holders = [f"graph captured at {site}" for site in self.graphs]
        if self.other_references:
            holders.append(f"{self.other_references} other reference(s)")
        return holders

    @contextmanager
    def capture_into_pool(self, site: str) -> Iterator[str]:
        """Pretend to capture a graph at ``site`` into the pool."""
        self._maybe_fail("capture", site)
        if self.pool is None:
            self.pool = f"pool-{next(self._pool_ids)}"
            self._tags.setdefault(CUDAGRAPH, _Tag(0))
        yield self.pool
        self.graphs.append(site)
        self._tags[CUDAGRAPH].size += 1 << 20

    def release_cudagraph_pool(self) -> int:
        """Drop the pool once no graph holds it; return its bytes."""
        self._maybe_fail("release_pool", CUDAGRAPH)
        holders = self.cudagraph_pool_holders()
        if holders:
            raise PoolBusy("cudagraph pool is still referenced", holders)
        freed = self._tags[CUDAGRAPH].size if CUDAGRAPH in self._tags else 0
        if CUDAGRAPH in self._tags:
            self._tags[CUDAGRAPH].size = 0
        self.pool = None
        return freed


@contextmanager
def capture_events(
    controller: SleepController, kinds: Iterable[EventKind | str] | None = None
) -> Iterator[list[Event]]:
    """Collect the events ``controller`` records inside the block."""
    seen: list[Event] = []
    unsubscribe = controller.subscribe(seen.append, kinds)
    try:
        yield seen
    finally:
        unsubscribe()
