"""Keep chosen address ranges of a tag across a discard: backed up and restored like an offload, only for those ranges.

A level-2 sleep discards ``weights`` and the engine reloads its parameters (a
``state_dict``) after the wake. What no reload restores (a module's
non-persistent buffers such as rotary ``inv_freq``, tensors held as plain
attributes) lives at addresses inside that same tag. A *keep source* names
those ranges (:mod:`torpor.allocator.keep.modules` finds them for a torch module);
:class:`Keeping` copies them to pinned host memory when the tag is released
without a backup, and back into the fresh mapping when the tag is restored
without one, before the wake returns. Mechanism only: which tags are
discarded, and when, is the controller's plan; which ranges, the source's.
A tag released with a backup (level 1) needs nothing kept: the backup holds
every byte.

It changes nothing for a tag without a source: its release and restore are
:class:`~torpor.allocator.sleepwake.cycle.SleepWake`'s, untouched.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from torpor.allocator.errors import wrap
from torpor.allocator.keep.modules import ModuleTracker
from torpor.allocator.keep.ranges import KeepSource, KeptRange
from torpor.allocator.native import library as native
from torpor.allocator.native.driver import Driver
from torpor.allocator.native.table import NativeTable
from torpor.allocator.sleepwake.cycle import SleepWake, TagState
from torpor.statemachine.core.protocol import Transfer

logger = logging.getLogger("torpor.allocator")


@dataclass
class Kept:
    """One tag's kept copy: pinned host memory and where each range came from."""

    host: int = 0
    nbytes: int = 0
    ranges: list[tuple[int, int, int, int]] = field(default_factory=list)  # (address, nbytes, device, host offset)
    names: list[str] = field(default_factory=list)


@dataclass
class KeepBook:
    """Sources per tag and the copies kept now."""

    sources: dict[str, list[KeepSource]] = field(default_factory=dict)
    kept: dict[str, Kept] = field(default_factory=dict)


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


class Keeping(SleepWake):
    """Release and restore that keep each tag's sourced ranges across a discard (mixed into TaggedAllocator)."""

    driver: Driver
    table: NativeTable
    _lock: threading.RLock
    _tags: dict[str, TagState]

    @property
    def _keep(self) -> KeepBook:
        book = self.__dict__.get("_keep_book")
        if book is None:
            book = self.__dict__["_keep_book"] = KeepBook()
        return book

    def keep(self, tag: str, source: KeepSource) -> Callable[[], None]:
        """Keep ``source``'s ranges of ``tag`` whenever ``tag`` is released without a backup; returns its remover."""
        with self._lock:
            self.tag_state(tag)
            self._keep.sources.setdefault(tag, []).append(source)

        def remove() -> None:
            with self._lock:
                listed = self._keep.sources.get(tag, [])
                if source in listed:
                    listed.remove(source)

        return remove

    def track(self, module: object, tag: str = "weights", *, check: bool = True) -> KeepSource:
        """Keep what no ``state_dict`` reload restores of ``module`` (a torch module, or any :class:`KeepSource`).

        Returns the source: for a module a
        :class:`~torpor.allocator.keep.modules.ModuleTracker`, whose ``check_reloaded()``
        names each parameter the reload left unwritten (``check``) and whose
        ``untrack()`` stops keeping it.
        """
        if isinstance(module, KeepSource):
            source: KeepSource = module
        else:
            source = ModuleTracker(module, tag, check=check)  # the torch side (imports torch when used)
        remove = self.keep(tag, source)
        if hasattr(source, "untrack"):
            source.untrack = remove
        return source

    def tag_state(self, tag: str) -> TagState:  # provided by TaggedAllocator
        raise NotImplementedError

    def kept_bytes(self, tag: str | None = None) -> int:
        """Host bytes kept now for released tags (of ``tag``, or of all)."""
        with self._lock:
            return sum(k.nbytes for t, k in self._keep.kept.items() if tag is None or t == tag)

    def kept_names(self, tag: str) -> list[str]:
        """What the kept copy of ``tag`` holds (the sources' names), empty when nothing is kept."""
        with self._lock:
            kept = self._keep.kept.get(tag)
            return list(kept.names) if kept is not None else []

    # -- the memory protocol, wrapped ------------------------------------------------------------

    def release(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """:meth:`SleepWake.release`; a tag released without a backup first has its sourced ranges copied out."""
        with self._lock:
            saved: list[str] = []
            try:
                for tag in tags:
                    if self._discarding(tag):
                        self._free_kept(tag)  # an older copy never comes back in place of this one
                        if self._save(tag):
                            saved.append(tag)
                out = super().release(tags)
            except BaseException:
                for tag in saved:  # a tag left resident keeps nothing
                    if self.table.usage(tag)[0] != native.RELEASED:
                        self._free_kept(tag)
                raise
            return {t: replace(x, kept=self._keep.kept[t].nbytes) if t in saved else x for t, x in out.items()}

    def restore(self, tags: Sequence[str]) -> dict[str, Transfer]:
        """:meth:`SleepWake.restore`; a tag restored without a backup then gets its kept ranges copied back."""
        with self._lock:
            fresh = [
                t
                for t in tags
                if t in self._keep.kept
                and t in self._tags
                and not self._tags[t].backed_up
                and self.table.usage(t)[0] == native.RELEASED
            ]
            out = super().restore(tags)
            try:
                for tag in fresh:
                    self._load(tag)
            except BaseException as exc:  # all or nothing: the tags this restore mapped go again (the copies stay)
                try:
                    SleepWake.release(self, tags)
                except Exception:
                    logger.exception("releasing %s again after copying kept ranges back failed", ", ".join(tags))
                if not isinstance(exc, Exception):
                    raise
                raise wrap(
                    "restore", fresh[0] if len(fresh) == 1 else None, exc, "kept ranges not copied back"
                ) from exc
            for tag in fresh:
                self._fresh_hooks(tag)
            return {t: replace(x, kept=self._keep.kept[t].nbytes) if t in fresh else x for t, x in out.items()}

    def drop_backup(self, tags: Sequence[str]) -> None:
        """:meth:`SleepWake.drop_backup`; the kept copies of the tags go too (after a wake, or before a sleep)."""
        with self._lock:
            super().drop_backup(tags)
            for tag in tags:  # a released tag's copy stays until the wake that uses it
                if tag not in self._tags or self.table.usage(tag)[0] != native.RELEASED:
                    self._free_kept(tag)

    def _close_kept(self) -> None:
        """Free every kept copy and forget the sources (the allocator's teardown, before the driver goes)."""
        with self._lock:
            for tag in list(self._keep.kept):
                self._free_kept(tag)
            self._keep.sources.clear()

    # -- internals ----------------------------------------------------------------------------

    def _discarding(self, tag: str) -> bool:
        record = self._tags.get(tag)
        return (
            bool(self._keep.sources.get(tag))
            and record is not None
            and not record.backed_up
            and self.table.usage(tag)[0] != native.RELEASED
        )

    def _save(self, tag: str) -> bool:
        """Copy the tag's sourced ranges to fresh pinned host memory; False when none lies in the tag."""
        wanted: list[KeptRange] = []
        for source in self._keep.sources.get(tag, []):
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
        self._keep.kept[tag] = kept
        return True

    def _load(self, tag: str) -> None:
        """Copy the kept ranges back into the tag's fresh mapping (ranges whose allocation was freed are skipped)."""
        kept = self._keep.kept[tag]
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

        for source in list(self._keep.sources.get(tag, [])):
            try:
                source.fresh(inside)
            except Exception:  # a source's hook never breaks the wake
                logger.exception("a keep source's fresh() hook failed for tag %r", tag)

    def _free_kept(self, tag: str) -> None:
        kept = self._keep.kept.pop(tag, None)
        if kept is not None and kept.host:
            self._free_host(kept.host)

    def _free_host(self, host: int) -> None:
        try:
            self.driver.host_free(host)
        except Exception:
            logger.exception("freeing %#x (a kept copy's host memory) failed", host)
