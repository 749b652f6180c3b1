"""Tests of torpor.switches: how an on/off environment variable reads."""

from __future__ import annotations

import pytest

from torpor.switches import env_switch


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, True),
        ("", True),
        (" 1 ", True),
        ("TRUE", True),
        ("on", True),
        ("0", False),
        ("false", False),
        ("Off", False),
    ],
)
def test_a_switch_is_on_unless_set_off(value: str | None, expected: bool) -> None:
    """Unset, empty, 1, true or on (any case, spaces around) is on; 0, false or off is off."""
    environ = {} if value is None else {"TORPOR_X": value}
    assert env_switch("TORPOR_X", environ) is expected


def test_a_value_that_is_no_switch_is_refused_naming_the_variable() -> None:
    """A typo is refused with the variable's name and value, not read as on or off."""
    with pytest.raises(ValueError, match="TORPOR_X='of' is not a switch"):
        env_switch("TORPOR_X", {"TORPOR_X": "of"})


def test_without_a_mapping_the_process_environment_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no mapping given, the switch is read from os.environ."""
    monkeypatch.setenv("TORPOR_X", "0")
    assert env_switch("TORPOR_X") is False
