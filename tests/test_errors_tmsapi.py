"""Tests of torpor.errors.tmsapi: torch_memory_saver API errors that carry what they name, where TMS exits."""

from __future__ import annotations

from torpor.errors import TagStateError, TmsConfigError, TmsError, TmsUsageError, TorporError


def test_tag_state_error_names_tag_state_and_the_way_out() -> None:
    """A double pause says the tag, its state, what pause needs and what to do."""
    err = TagStateError("pause", "weights", "asleep_l1", ("awake",))
    assert (err.command, err.tag, err.state, err.allowed) == ("pause", "weights", "asleep_l1", ("awake",))
    assert "'weights' is 'asleep_l1', not awake" in str(err) and "resume it first" in str(err)
    again = TagStateError("resume", "kv_cache", "awake", ("asleep_l1", "asleep_l2"))
    assert "not paused" in str(again) and "pause it first" in str(again)


def test_the_errors_are_torpor_errors_of_the_standard_kinds() -> None:
    """Each is a TorporError and a standard exception (RuntimeError, ValueError) callers already catch."""
    config = TmsConfigError("TMS_INIT_ENABLE", "on", "1 or 0")
    assert isinstance(config, TmsError) and isinstance(config, ValueError) and isinstance(config, TorporError)
    assert (config.name, config.value) == ("TMS_INIT_ENABLE", "on")
    assert isinstance(TmsUsageError("x"), RuntimeError)
    assert isinstance(TagStateError("pause", "t", "s", ()), RuntimeError)
