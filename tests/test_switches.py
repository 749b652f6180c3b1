"""Tests of torpor.switches: how an environment variable reads (on/off, rank, seconds, text, path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor.errors import BadSetting, TorporError
from torpor.switches import env_path, env_rank, env_seconds, env_switch, env_text


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


@pytest.mark.parametrize(("value", "expected"), [(None, 7.5), ("", 7.5), (" 0 ", 0.0), ("2.5", 2.5)])
def test_seconds_read_finite_and_not_negative(value: str | None, expected: float) -> None:
    """Seconds: unset or blank is the default; a finite number 0 or more (spaces around) is read as it is."""
    environ = {} if value is None else {"TORPOR_WAIT": value}
    assert env_seconds("TORPOR_WAIT", environ, default=7.5) == expected


@pytest.mark.parametrize("value", ["soon", "nan", "inf", "-1"])
def test_seconds_that_are_no_number_of_seconds_are_refused_naming_the_variable(value: str) -> None:
    """``nan``, ``inf``, a negative or no number is a BadSetting (a TorporError and a ValueError) naming the variable."""
    with pytest.raises(BadSetting, match=f"TORPOR_WAIT='{value}' is not a number of seconds") as caught:
        env_seconds("TORPOR_WAIT", {"TORPOR_WAIT": value}, default=1.0)
    assert isinstance(caught.value, TorporError) and isinstance(caught.value, ValueError)
    assert (caught.value.name, caught.value.value) == ("TORPOR_WAIT", value)


def test_text_and_paths_are_none_when_unset_or_empty() -> None:
    """Text and paths: None when unset or empty; the value as set (a path as a Path) otherwise."""
    assert env_text("TORPOR_T", {}) is None and env_text("TORPOR_T", {"TORPOR_T": ""}) is None
    assert env_text("TORPOR_T", {"TORPOR_T": " a b "}) == " a b "
    assert env_path("TORPOR_P", {"TORPOR_P": ""}) is None
    assert env_path("TORPOR_P", {"TORPOR_P": "/tmp/x"}) == Path("/tmp/x")
