"""TmsTag and TagView: a TMS tag's torpor tags, its policy, and a memory view that shows and moves only them."""

from __future__ import annotations

from support import RigMaker

from torpor.statemachine.core.policy import Action
from torpor.statemachine.core.protocol import Doors, GraphPoolMemory, Memory
from torpor.tms.tagview import TagView, TmsTag, action_of, mode_of
from torpor.units import MiB


def test_modes_and_actions() -> None:
    """Disk wins over CPU; a CPU backup is its backend; none is discard; only discard is not an offload."""
    assert mode_of(False, True, "pinned") == "disk"
    assert mode_of(True, False, "mmap") == "mmap"
    assert mode_of(False, False, "pinned") == "discard"
    assert [action_of(m) for m in ("discard", "pinned", "mmap", "disk")] == [Action.DISCARD] + [Action.OFFLOAD] * 3


def test_first_mode_names_the_torpor_tag_after_the_tms_tag() -> None:
    """The first mode gets the TMS tag's name, another TAG#MODE; asking again gives the same tag."""
    t = TmsTag("kv_cache")
    assert t.torpor_tag("discard") == "kv_cache"
    assert t.torpor_tag("pinned") == "kv_cache#pinned"
    assert t.torpor_tag("discard") == "kv_cache"
    assert t.policy().plan(1, ["kv_cache", "kv_cache#pinned"]) == {
        "kv_cache": Action.DISCARD,
        "kv_cache#pinned": Action.OFFLOAD,
    }


def test_the_policy_reads_the_tag_live() -> None:
    """A mode added after the controller's policy was built is in that policy (the same mapping)."""
    t = TmsTag("w")
    policy = t.policy()
    t.torpor_tag("discard")
    assert policy.plan(2, ["w"]) == {"w": Action.DISCARD}
    assert policy.wake_set(None, ["w"]) == ["w"]
    assert policy.wake_set([], ["w"]) == ["w"]  # nothing deferred: a resume restores all of the tag


def test_the_view_shows_and_moves_only_its_tags(make_rig: RigMaker) -> None:
    """usage() lists the view's tags only; release of another tag through the view touches nothing."""
    alloc = make_rig("cuda_like", capacity=64 * MiB).allocator
    mine, other = TmsTag("a"), TmsTag("b")
    for t in (mine, other):
        alloc.allocate(2 * MiB, tag=t.torpor_tag("discard"))
    view = TagView(alloc, mine)
    assert set(view.usage()) == {"a"}
    view.release(["b"])
    assert alloc.usage()["b"].resident == 2 * MiB
    view.release(["a"])
    assert alloc.usage()["a"].resident == 0
    view.restore(["a"])
    assert list(view.tags()) == ["a"]


def test_the_view_meets_the_protocols_the_controller_asks_for(make_rig: RigMaker) -> None:
    """The view is a Memory, has doors and a graph pool, as the allocator is."""
    view = TagView(make_rig("cuda_like", capacity=16 * MiB).allocator, TmsTag("a"))
    assert isinstance(view, Memory)
    assert isinstance(view, Doors)
    assert isinstance(view, GraphPoolMemory)
