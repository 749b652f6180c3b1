"""Tests of torpor.allocator.kept_ranges.modules on CPU modules: what a state_dict reload cannot restore, and the reload check."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torpor.allocator.kept_ranges.modules import ModuleTracker, NotReloaded, unrestorable  # noqa: E402


class Rotary(torch.nn.Module):
    """A rotary embedding as transformers writes it: inv_freq non-persistent, original_inv_freq a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.original_inv_freq = inv.clone()
        self.alias = self.inv_freq  # the same storage again: kept once


class Block(torch.nn.Module):
    """A linear layer, a persistent buffer, a rotary, caches in a list and a dict, and a tensor aliasing a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.rotary = Rotary()
        self.caches = [torch.zeros(3), 7]
        self.by_name = {"cos": torch.zeros(2)}
        self.weight_ref = self.proj.weight.data  # shares a parameter's storage: the reload writes it


def test_finds_non_persistent_buffers_and_tensor_attributes_once() -> None:
    """Non-persistent buffers and plain tensor attributes are found, each storage once; reloadable ones are not."""
    found = [name for name, _ in unrestorable(Block())]
    assert sorted(found) == ["by_name['cos']", "caches[0]", "rotary.inv_freq", "rotary.original_inv_freq"]


def test_ranges_cover_each_storage_and_vanish_with_the_module() -> None:
    """Each range is a whole storage (address, bytes); a module that is gone has none."""
    block = Block()
    tracker = ModuleTracker(block, "weights")
    ranges = {r.name: r for r in tracker.ranges()}
    inv = block.rotary.inv_freq
    assert (ranges["rotary.inv_freq"].address, ranges["rotary.inv_freq"].nbytes) == (inv.data_ptr(), 16)
    del block, inv
    assert tracker.ranges() == []


def test_the_reload_check_names_each_tensor_the_reload_skipped() -> None:
    """After fresh() fills reloadable tensors, a partial reload leaves the rest named by check_reloaded()."""
    block = Block()
    state = {k: v.clone() for k, v in block.state_dict().items()}
    tracker = ModuleTracker(block, "weights")
    tracker.fresh(lambda address, nbytes: True)
    assert torch.isnan(block.proj.weight).all()
    assert sorted(tracker.unreloaded()) == ["proj.bias", "proj.weight", "scale"]
    block.load_state_dict({"proj.weight": state["proj.weight"], "scale": state["scale"]}, strict=False)
    with pytest.raises(NotReloaded, match=r"1 tracked tensor\(s\) of tag 'weights'.*proj\.bias") as info:
        tracker.check_reloaded()
    assert info.value.names == ["proj.bias"]
    block.load_state_dict(state)
    tracker.check_reloaded()
    assert torch.equal(block.proj.bias, state["proj.bias"])


def test_fresh_fills_only_tensors_inside_the_tag_and_not_without_check() -> None:
    """fresh() leaves tensors outside the tag alone, and does nothing when the check is off."""
    block = Block()
    before = block.proj.weight.clone()
    ModuleTracker(block, "weights").fresh(lambda address, nbytes: address != block.proj.weight.data_ptr())
    assert torch.equal(block.proj.weight, before) and torch.isnan(block.proj.bias).all()
    other = Block()
    ModuleTracker(other, "weights", check=False).fresh(lambda address, nbytes: True)
    assert not torch.isnan(other.proj.weight).any()
