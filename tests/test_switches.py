"""Tests of torpor.switches: how an on/off environment variable reads."""

from __future__ import annotations

import pytest

from torpor.switches import env_rank, env_switch


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


@pytest.mark.parametrize(("value", "expected"), [(None, False), ("", False), ("  ", False), ("on", True), ("0", False)])
def test_a_switch_that_defaults_off_is_off_when_unset_or_empty(value: str | None, expected: bool) -> None:
    """With default=False, unset or empty is off; the same words turn it on or off."""
    environ = {} if value is None else {"TORPOR_X": value}
    assert env_switch("TORPOR_X", environ, default=False) is expected


@pytest.mark.parametrize(
    ("value", "expected"), [(None, None), ("", None), ("0", 0), (" 1", 1), ("1 ", 1), ("+1", 1), ("17", 17)]
)
def test_a_rank_reads_as_int_does(value: str | None, expected: int | None) -> None:
    """A rank is a decimal integer, spaces around and a plus sign allowed as int() allows them; unset or blank is None."""
    environ = {} if value is None else {"RANK": value}
    assert env_rank("RANK", environ) == expected


@pytest.mark.parametrize("value", ["-1", "²", "1_0", "0x1", "one", "1.0", "١"])
def test_a_rank_that_is_no_decimal_count_is_refused_naming_the_variable(value: str) -> None:
    """A negative, a superscript, an underscore, hex, a word, a float or a non-ASCII digit is refused naming RANK."""
    with pytest.raises(ValueError, match=r"^RANK=.* is not a rank \(a whole number, 0 or more\)"):
        env_rank("RANK", {"RANK": value})
