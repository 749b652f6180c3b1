"""Keep chosen address ranges of a tag across a discard: backed up and restored like an offload, only for those ranges.

A level-2 sleep discards ``weights`` and the engine reloads its parameters (a
``state_dict``) after the wake. What no reload restores (a module's
non-persistent buffers such as rotary ``inv_freq``, tensors held as plain
attributes) lives at addresses inside that same tag. A *keep source* names
those ranges (:mod:`torpor.allocator.kept_ranges.modules` finds them for a torch module);
:class:`KeepBook` copies them to pinned host memory when the tag is released
without a backup, and back into the fresh mapping when the tag is restored
without one, before the wake returns. Mechanism only: which tags are
discarded, and when, is the controller's plan; which ranges, the source's.
A tag released with a backup (level 1) needs nothing kept: the backup holds
every byte.

:class:`KeepBook` is a part ``TaggedAllocator`` owns: its release calls
:meth:`KeepBook.save` before the sleep/wake cycle's release (and
:meth:`KeepBook.unsave` when that fails), its restore :meth:`KeepBook.load`
after the cycle's restore. It changes nothing for a tag without a source.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torpor.allocator.failures import wrap
from torpor.allocator.kept_ranges.modules import ModuleTracker
from torpor.allocator.kept_ranges.ranges import KeepSource, KeptRange
from torpor.allocator.native import library as native
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.tagbook import TagBook
from torpor.statemachine.core.protocol import Transfer

logger = logging.getLogger("torpor.allocator")


@dataclass
class Kept:
    """One tag's kept copy: pinned host memory and where each range came from."""

    host: int = 0
    nbytes: int = 0
    ranges: list[tuple[int, int, int, int]] = field(default_factory=list)  # (address, nbytes, device, host offset)
    names: list[str] = field(default_factory=list)


def merged(
    ranges: Sequence[KeptRange], live: Sequence[tuple[int, int, int]]
) -> tuple[list[tuple[int, int, int]], list[str]]:
    """The ranges inside one live allocation each, merged where they overlap: ``(address, nbytes, device)``, names."""
    inside: list[tuple[int, int, int, str]] = []
    for r in ranges:
        for a, n, d in live:
            if r.nbytes > 0 and a <= r.address and r.address + r.nbytes <= a + n:
                inside.append((r.address, r.address + r.nbytes, d, r.name))
                break
    inside.sort()
    out: list[list[int]] = []
    names: list[str] = []
    for lo, hi, d, name in inside:
        names.append(name)
        if out and lo <= out[-1][1] and d == out[-1][2]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi, d])
    return [(lo, hi - lo, d) for lo, hi, d in out], names


class KeepBook:
    """The keep sources per tag and the copies kept now, over one driver, table and tag book (its records).

    It works under the book's lock, as the sleep/wake cycle does (Invariant: the allocator's lock order).
    """

    def __init__(self, *, driver: Driver, table: NativeTable, book: TagBook) -> None:
        self.driver = driver
        self.table = table
        self.book = book
        self.sources: dict[str, list[KeepSource]] = {}
        self.kept: dict[str, Kept] = {}
        self._lock = book.lock
        self._tags = book.records

    def keep(self, tag: str, source: KeepSource) -> Callable[[], None]:
        """Keep ``source``'s ranges of ``tag`` whenever ``tag`` is released without a backup; returns its remover."""
        with self._lock:
            self.book.state(tag)
            self.sources.setdefault(tag, []).append(source)

        def remove() -> None:
            with self._lock:
                listed = self.sources.get(tag, [])
                if source in listed:
                    listed.remove(source)

        return remove

    def track(self, module: object, tag: str, *, check: bool) -> KeepSource:
        """Keep what no ``state_dict`` reload restores of ``module`` (a torch module, or any :class:`KeepSource`)."""
        if isinstance(module, KeepSource):
            source: KeepSource = module
        else:
            source = ModuleTracker(module, tag, check=check)  # the torch side (imports torch when used)
        remove = self.keep(tag, source)
        if hasattr(source, "untrack"):
            source.untrack = remove
        return source

    def kept_bytes(self, tag: str | None = None) -> int:
        """Host bytes kept now for released tags (of ``tag``, or of all)."""
        with self._lock:
            return sum(k.nbytes for t, k in self.kept.items() if tag is None or t == tag)

    def kept_names(self, tag: str) -> list[str]:
        """What the kept copy of ``tag`` holds (the sources' names), empty when nothing is kept."""
        with self._lock:
            kept = self.kept.get(tag)
            return list(kept.names) if kept is not None else []

    # -- around the cycle's release, restore and drop_backup ---------------------------------------

    def save(self, tags: Sequence[str]) -> list[str]:
        """Before a release: copy out the sourced ranges of each tag released without a backup; the tags kept.

        A failure frees what this call kept (every tag is still resident) and raises.
        """
        with self._lock:
            saved: list[str] = []
            try:
                for tag in tags:
                    if self._discarding(tag):
                        self._free_kept(tag)  # an older copy never comes back in place of this one
                        if self._save(tag):
                            saved.append(tag)
            except BaseException:
                self.unsave(saved)
                raise
            return saved

    def unsave(self, saved: Sequence[str]) -> None:
        """The release of ``saved`` failed: a tag left resident keeps nothing."""
        with self._lock:
            for tag in saved:
                if self.table.usage(tag).state != native.RELEASED:
                    self._free_kept(tag)

    def counted(self, out: dict[str, Transfer], tags: Sequence[str]) -> dict[str, Transfer]:
        """``out`` with the kept bytes of ``tags`` in their transfers (``Transfer.kept``)."""
        return {t: replace(x, kept=self.kept[t].nbytes) if t in tags else x for t, x in out.items()}

    def to_load(self, tags: Sequence[str]) -> list[str]:
        """Before a restore: the tags it maps fresh (released without a backup) whose kept ranges go back after it."""
        with self._lock:
            return [
                t
                for t in tags
                if t in self.kept
                and t in self._tags
                and not self._tags[t].backed_up
                and self.table.usage(t).state == native.RELEASED
            ]

    def load(self, fresh: Sequence[str], tags: Sequence[str], release: Callable[[Sequence[str]], object]) -> None:
        """After the restore of ``tags``: copy the kept ranges of ``fresh`` back, then call their sources' hooks.

        All or nothing: when a copy fails, ``release(tags)`` (the cycle's) releases the tags the restore
        mapped again, the copies stay, and the error says the kept ranges were not copied back.
        """
        with self._lock:
            try:
                for tag in fresh:
                    self._load(tag)
            except BaseException as exc:
                try:
                    release(tags)
                except Exception:
                    logger.exception("releasing %s again after copying kept ranges back failed", ", ".join(tags))
                if not isinstance(exc, Exception):
                    raise
                raise wrap(
                    "restore", fresh[0] if len(fresh) == 1 else None, exc, "kept ranges not copied back"
                ) from exc
            for tag in fresh:
                self._fresh_hooks(tag)

    def dropped(self, tags: Sequence[str]) -> None:
        """After drop_backup: the kept copies of the tags go too (after a wake, or before a sleep)."""
        with self._lock:
            for tag in tags:  # a released tag's copy stays until the wake that uses it
                if tag not in self._tags or self.table.usage(tag).state != native.RELEASED:
                    self._free_kept(tag)

    def close(self) -> None:
        """Free every kept copy and forget the sources (the allocator's teardown, before the driver goes)."""
        with self._lock:
            for tag in list(self.kept):
                self._free_kept(tag)
            self.sources.clear()

    # -- internals ----------------------------------------------------------------------------

    def _discarding(self, tag: str) -> bool:
        record = self._tags.get(tag)
        return (
            bool(self.sources.get(tag))
            and record is not None
            and not record.backed_up
            and self.table.usage(tag).state != native.RELEASED
        )

    def _save(self, tag: str) -> bool:
        """Copy the tag's sourced ranges to fresh pinned host memory; False when none lies in the tag."""
        wanted: list[KeptRange] = []
        for source in self.sources.get(tag, []):
            wanted.extend(source.ranges())
        ranges, names = merged(wanted, self.table.allocations(tag))
        total = sum(n for _, n, _ in ranges)
        if not total:
            return False
        devices = sorted({d for _, _, d in ranges})
        kept = Kept()
        try:
            for device in devices:  # the engine's writes land first
                self.driver.synchronize(device)
            kept.host = self.driver.host_alloc(total)
            kept.nbytes = total
            offset = 0
            for address, n, device in ranges:
                self.driver.copy_d2h(kept.host + offset, address, n, device)
                kept.ranges.append((address, n, device, offset))
                offset += n
            for device in devices:
                self.driver.wait(self.driver.record(device))
        except BaseException as exc:
            if kept.host:
                self._free_host(kept.host)
            if not isinstance(exc, Exception):
                raise
            raise wrap("release", tag, exc, "tracked ranges not kept; tag left resident") from exc
        kept.names = names
        self.kept[tag] = kept
        return True

    def _load(self, tag: str) -> None:
        """Copy the kept ranges back into the tag's fresh mapping (ranges whose allocation was freed are skipped)."""
        kept = self.kept[tag]
        live = self.table.allocations(tag)
        devices = set()
        for address, n, device, offset in kept.ranges:
            if any(a <= address and address + n <= a + size for a, size, _ in live):
                self.driver.copy_h2d(address, kept.host + offset, n, device)
                devices.add(device)
        for device in sorted(devices):
            self.driver.wait(self.driver.record(device))

    def _fresh_hooks(self, tag: str) -> None:
        live = self.table.allocations(tag)

        def inside(address: int, nbytes: int) -> bool:
            return any(a <= address and address + nbytes <= a + n for a, n, _ in live)

        for source in list(self.sources.get(tag, [])):
            try:
                source.fresh(inside)
            except Exception:  # a source's hook never breaks the wake
                logger.exception("a keep source's fresh() hook failed for tag %r", tag)

    def _free_kept(self, tag: str) -> None:
        kept = self.kept.pop(tag, None)
        if kept is not None and kept.host:
            self._free_host(kept.host)

    def _free_host(self, host: int) -> None:
        try:
            self.driver.host_free(host)
        except Exception:
            logger.exception("freeing %#x (a kept copy's host memory) failed", host)
