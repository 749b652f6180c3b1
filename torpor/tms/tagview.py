"""One TMS tag as torpor sees it: the torpor tags its regions made, a memory view over them, and the policy they imply.

Why it exists: TMS pauses and resumes each tag on its own (``pause("kv_cache")``
while ``weights`` stay awake, then ``pause("weights")``), while torpor's
controller sleeps an engine once (``sleep`` is accepted from ``awake`` and
``partially_awake``, not from ``asleep_l1``). So each TMS tag is one torpor
engine: a :class:`~torpor.SleepController` over a :class:`TagView` of the
shared :class:`~torpor.allocator.TaggedAllocator` that shows only that tag's
torpor tags, with a policy built from its regions' settings (CPU or disk
backup: ``offload``; none: ``discard``). ``pause(tag)`` is that engine's
``sleep(1)`` and ``resume(tag)`` its ``wake()``; nothing here changes the
controller, the allocator or the state machine (docs/tms.md, "How a tag maps").

A torpor tag whose region keeps a CPU or disk backup is offloaded into
:class:`~torpor.tms.shadows.ShadowStore` (one host copy per allocation, as TMS
keeps them) and released and mapped back by the allocator as a discarded tag
is; the graph pool keeps the allocator's own backup.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

from torpor.allocator import GRAPH_TAG, TaggedAllocator
from torpor.statemachine.core.policy import Action, Policy
from torpor.statemachine.core.protocol import DeviceMemory, TagUsage, Transfer
from torpor.tms.shadows import MODES, ShadowStore

#: A region's backup mode: none (discarded on pause), a CPU backup backend, or disk.
DISCARD_MODE = "discard"
DISK_MODE = "disk"


def mode_of(enable_cpu_backup: bool, enable_disk_backup: bool, backend: str) -> str:
    """The backup mode of a region: ``disk``, the CPU backend (``pinned``/``mmap``), or ``discard``."""
    if enable_disk_backup:
        return DISK_MODE
    return backend if enable_cpu_backup else DISCARD_MODE


def action_of(mode: str) -> Action:
    """What pause does to memory of ``mode``: a backup of any kind is an offload, none a discard."""
    return Action.DISCARD if mode == DISCARD_MODE else Action.OFFLOAD


@dataclass
class TmsTag:
    """One TMS tag: its torpor tags by backup mode, and the action of each (the policy's live mapping).

    The first mode a tag is used with names the torpor tag after the TMS tag
    itself; a region of the same tag with another mode gets ``TAG#MODE`` (TMS
    keys its pools by tag and settings the same way), and ``pause(TAG)`` pauses
    both. The graph pool (torpor tag ``cudagraph``) joins the tag that
    ``cuda_graph()`` names first, and is always offloaded (graphs hold write-once state).
    """

    name: str
    modes: dict[str, str] = field(default_factory=dict)  # mode -> torpor tag
    actions: dict[str, Action] = field(default_factory=dict)  # torpor tag -> action (the policy reads it live)

    def torpor_tag(self, mode: str) -> str:
        """The torpor tag for a region of this tag in ``mode`` (made on first use)."""
        tag = self.modes.get(mode)
        if tag is None:
            tag = self.name if not self.modes else f"{self.name}#{mode}"
            self.modes[mode] = tag
            self.actions[tag] = action_of(mode)
        return tag

    def adopt_graph_pool(self) -> None:
        """The graph pool is this tag's from now on (offloaded at every pause)."""
        self.actions[GRAPH_TAG] = Action.OFFLOAD

    def mode(self, torpor_tag: str) -> str | None:
        """The backup mode of ``torpor_tag`` (None: not one of this tag's regions, e.g. the graph pool)."""
        return next((m for m, t in self.modes.items() if t == torpor_tag), None)

    def owns(self, torpor_tag: str) -> bool:
        """Whether ``torpor_tag`` belongs to this TMS tag."""
        return torpor_tag in self.actions

    def policy(self) -> Policy:
        """The controller's policy: the same live actions at both levels, nothing deferred (a resume restores all)."""
        return Policy(levels={1: self.actions, 2: self.actions}, deferrable=frozenset())


class TagView:
    """The memory protocol over the torpor tags of one :class:`TmsTag`; every call goes to the shared allocator.

    Also forwards the optional protocols the controller asks for (the doors
    around a sleep, host and device bytes, the graph pool), so the controller
    drives it exactly as it drives the allocator itself.
    """

    def __init__(self, allocator: TaggedAllocator, tag: TmsTag) -> None:
        self.allocator = allocator
        self.tag = tag

    def _mine(self, tags: Sequence[str]) -> list[str]:
        return [t for t in tags if self.tag.owns(t)]

    def usage(self) -> dict[str, TagUsage]:
        """Bytes of this TMS tag's torpor tags (those with memory); a shadowed tag's host bytes are its store's."""
        mine = {t: u for t, u in self.allocator.usage().items() if self.tag.owns(t)}
        for t in self._shadowed(list(mine)):
            mine[t] = replace(mine[t], host=self.shadows.host_bytes(t))
        return mine

    @property
    def shadows(self) -> ShadowStore:
        """Where this view's CPU and disk backups live (the allocator's store)."""
        return ShadowStore.of(self.allocator)

    def _shadowed(self, tags: Sequence[str]) -> list[str]:
        return [t for t in tags if self.tag.mode(t) in MODES]

    def backup(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        """Back up ``tags`` (all this view's): shadowed ones into the store (each frozen first), the rest by the allocator."""
        mine = self._mine(tags)
        shadowed = self._shadowed(mine)
        out = dict(self.allocator.backup([t for t in mine if t not in shadowed]))
        native = self.allocator.native_entry
        frozen: list[str] = []
        try:
            for tag in shadowed:
                start = time.perf_counter()
                self.allocator.tag_state(tag)
                native.freeze(tag)  # Invariant: freeze before copy (no allocation joins a tag being copied)
                frozen.append(tag)
                done = self.shadows.save(tag, self.tag.mode(tag) or "")
                out[tag] = Transfer(tag, done, time.perf_counter() - start, offloaded=True)
        except BaseException:
            for tag in frozen:
                native.thaw(tag)
            raise
        return out

    def release(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        """Release ``tags`` through the allocator (a shadowed tag's transfer says it was offloaded)."""
        mine = self._mine(tags)
        shadowed = self._shadowed(mine)
        out = dict(self.allocator.release(mine))
        return {t: replace(x, offloaded=True) if t in shadowed else x for t, x in out.items()}

    def restore(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        """Map ``tags`` back through the allocator, then copy each shadowed tag's store in (released again if that fails)."""
        mine = self._mine(tags)
        out = dict(self.allocator.restore(mine))
        for tag in self._shadowed(mine):
            try:
                _, checked = self.shadows.load(tag)
            except BaseException:  # a failed copy, or bytes that differ from the pause's (WakeCheckFailed)
                self.allocator.release([tag])
                raise
            out[tag] = replace(out[tag], offloaded=True, checked=checked)
        return out

    def drop_backup(self, tags: Sequence[str]) -> None:
        """Drop the backups of ``tags``: the allocator's, and the store's (CPU ones kept with ``retain_cpu_backup``)."""
        mine = self._mine(tags)
        self.allocator.drop_backup(mine)
        for tag in self._shadowed(mine):
            self.shadows.drop(tag)

    def pinned_bytes(self) -> int:
        """Pinned host bytes the allocator holds (all tags: the host arena is shared)."""
        return self.allocator.pinned_bytes()

    def device_memory(self) -> DeviceMemory:
        """Device memory as the allocator sees it."""
        return self.allocator.device_memory()

    def close_doors(self, tags: Sequence[str], cause: str, timeout: float) -> None:
        """Refuse new blocks of ``tags`` while they go to sleep."""
        self.allocator.close_doors(self._mine(tags), cause, timeout)

    def open_doors(self, tags: Sequence[str]) -> None:
        """Let blocks of ``tags`` start again."""
        self.allocator.open_doors(self._mine(tags))

    def cudagraph_pool_holders(self) -> Sequence[str]:
        """Everything that references the graph pool."""
        return self.allocator.cudagraph_pool_holders()

    def capture_into_pool(self, site: str) -> AbstractContextManager[object]:
        """Capture one graph into the graph pool (which this view's tag owns)."""
        return self.allocator.capture_into_pool(site)

    def release_cudagraph_pool(self) -> int:
        """Drop the graph pool."""
        return self.allocator.release_cudagraph_pool()

    def tags(self) -> Iterator[str]:
        """This view's torpor tags."""
        return iter(sorted(self.tag.actions))
