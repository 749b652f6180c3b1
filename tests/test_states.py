"""Tests for torpor.statemachine.states: the table, allowed sources and the committed diagram."""

from __future__ import annotations

from pathlib import Path

from torpor.statemachine.states import COMMANDS, TRANSITIONS, State, allowed_sources, diagram_markdown, mermaid

ROOT = Path(__file__).resolve().parent.parent


def test_every_state_reachable_in_table() -> None:
    """Every state appears as a destination or is the initial state."""
    dests = {row["dest"] for row in TRANSITIONS if row["dest"]}
    assert {s.value for s in State} - dests == {State.AWAKE.value} - dests


def test_allowed_sources_for_wake() -> None:
    """Wake is allowed from both asleep states and partially_awake only."""
    assert set(allowed_sources("wake")) == {"asleep_l1", "asleep_l2", "partially_awake"}


def test_capture_only_while_awake() -> None:
    """Capturing into the graph pool is allowed only while awake."""
    assert allowed_sources("capture") == ("awake",)


def test_every_command_is_a_trigger() -> None:
    """Each public command has at least one row in the table."""
    for command in COMMANDS:
        assert allowed_sources(command), command


def test_mermaid_lists_every_row() -> None:
    """The diagram has one edge per (row, source) pair of the table."""
    edges = [line for line in mermaid().splitlines() if "-->" in line and "[*]" not in line]
    expected = sum(len(r["source"]) if isinstance(r["source"], list) else 1 for r in TRANSITIONS)
    assert len(edges) == expected


def test_committed_diagram_is_current() -> None:
    """docs/state-diagram.md equals what `torpor diagram --markdown` generates."""
    assert (ROOT / "docs" / "state-diagram.md").read_text() == diagram_markdown()
