"""Tests of torpor.statemachine.core.protocol: a memory's capabilities, said once or read from its methods."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from torpor import SleepController
from torpor.statemachine.core.protocol import Abilities, Capability, TagUsage, Transfer, capabilities_of


class Minimal:
    """The five methods of the memory protocol, nothing more, and no capabilities() (a memory of before)."""

    def usage(self) -> Mapping[str, TagUsage]:
        return {"weights": TagUsage(resident=4096, allocations=1)}

    def backup(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        return {t: Transfer(t, 4096, 0.0, offloaded=True) for t in tags}

    def release(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        return {t: Transfer(t, 4096, 0.0) for t in tags}

    def restore(self, tags: Sequence[str]) -> Mapping[str, Transfer]:
        return {t: Transfer(t, 4096, 0.0) for t in tags}

    def drop_backup(self, tags: Sequence[str]) -> None:
        return None


class Pinning(Minimal):
    """A memory of before that reports pinned bytes and device memory by its methods alone."""

    def pinned_bytes(self) -> int:
        return 7

    def close_doors(self, tags: Sequence[str], cause: str, timeout: float) -> None:
        return None

    def open_doors(self, tags: Sequence[str]) -> None:
        return None


class SaysDoors(Pinning):
    """Says it has only doors: its pinned_bytes method is then not asked."""

    @classmethod
    def capabilities(cls) -> frozenset[Capability]:
        return frozenset({Capability.DOORS})


class SaysWhatItLacks(Minimal):
    """Says it owns a graph pool without the pool's methods."""

    @classmethod
    def capabilities(cls) -> frozenset[str]:
        return frozenset({"graph_pool"})


def test_a_memory_that_says_nothing_has_the_capabilities_its_methods_show() -> None:
    """Without capabilities(), each capability whose methods the memory has is found; the minimal memory has none."""
    assert capabilities_of(Minimal()) == frozenset()
    assert capabilities_of(Pinning()) == {Capability.PINNED, Capability.DOORS}


def test_a_memory_that_says_its_capabilities_has_those_only() -> None:
    """capabilities() is what counts: a method it does not name is not asked (the sleep records no pinned bytes)."""
    assert capabilities_of(SaysDoors()) == {Capability.DOORS}
    ctl = SleepController(SaysDoors())
    ctl.sleep(1)
    assert ctl.events()[-1].data["pinned"] == 0
    inferred = SleepController(Pinning())  # says nothing: its pinned_bytes is read
    inferred.sleep(1)
    assert inferred.events()[-1].data["pinned"] == 7


def test_a_capability_said_without_its_methods_is_refused_before_anything_is_made() -> None:
    """A memory naming a capability it lacks the methods of is a TypeError naming it, at construction."""
    with pytest.raises(TypeError, match="graph_pool"):
        SleepController(SaysWhatItLacks())


def test_an_unknown_capability_name_is_refused() -> None:
    """capabilities() naming no Capability is a TypeError listing the known ones."""

    class Odd(Minimal):
        @classmethod
        def capabilities(cls) -> tuple[str, ...]:
            return ("teleport",)

    with pytest.raises(TypeError, match=r"unknown capability.*known: host"):
        capabilities_of(Odd())


def test_host_includes_pinned_and_abilities_hand_out_the_memory_per_capability() -> None:
    """A HOST memory reports pinned bytes too; Abilities holds the memory where it has the capability, else None."""

    class Host(Minimal):
        @classmethod
        def capabilities(cls) -> set[Capability]:
            return {Capability.HOST}

        def pinned_bytes(self) -> int:
            return 1

        def configure_host(
            self, *, prepin: bool, limit_bytes: int | None, prepin_exclude: frozenset[str] = frozenset()
        ) -> None:
            return None

        def trim_host(self, background: bool = False) -> int:
            return 0

    memory = Host()
    abilities = Abilities.of(memory)
    assert abilities.capabilities == {Capability.HOST, Capability.PINNED}
    assert abilities.host is memory and abilities.pinned is memory
    assert abilities.doors is None and abilities.graphs is None and abilities.device is None
