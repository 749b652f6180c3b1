"""Tests for torpor.statemachine.core.enginename: one rule for an engine name, checked wherever a name enters."""

from __future__ import annotations

from pathlib import Path

import pytest

from torpor import SleepController
from torpor.hooks.vllm.settings import ENV_ENGINE, engine_name
from torpor.statemachine.core.enginename import MAX_ENGINE_NAME, check_engine_name
from torpor.testing import FakeMemory

TAGS = {"weights": 4000, "kv_cache": 8000}

REFUSED = [
    ("e\r\nSet-Cookie: stolen=1", "U+000D"),
    ("line\nbreak", "U+000A"),
    ("nul\0", "U+0000"),
    ("esc\x1b[31m", "U+001B"),
    ("tab\there", "U+0009"),
    ("rtl\u202eoverride", "U+202E"),
    ("zero\u200bwidth", "U+200B"),
    ("para\u2029sep", "U+2029"),
    ("nbsp\u00a0name", "U+00A0"),
    ("lone\ud800", "U+D800"),
    ("", "empty"),
    (" padded", "space"),
    ("padded ", "space"),
    ("x" * (MAX_ENGINE_NAME + 1), f"{MAX_ENGINE_NAME} bytes"),
    ("模" * 67, f"{MAX_ENGINE_NAME} bytes"),  # 201 bytes of UTF-8 in 67 characters
]
ACCEPTED = ["llm0", "模型-0", 'odd "name"/with spaces', "vllm-123-dp1", "x" * MAX_ENGINE_NAME, "模" * 66, "café ☕"]


@pytest.mark.parametrize(("engine", "rule"), REFUSED, ids=[repr(e)[:24] for e, _ in REFUSED])
@pytest.mark.parametrize("log", ["memory", "file", "directory"])
def test_a_controller_refuses_an_engine_name_outside_the_rule(tmp_path: Path, engine: str, rule: str, log: str) -> None:
    """A name with a control, format or separator character, empty, padded or over 200 bytes: refused naming it and the rule, nothing made."""
    where = {"memory": None, "file": tmp_path / "logs" / "e.jsonl", "directory": tmp_path / "logs" / "dir"}[log]
    with pytest.raises(ValueError, match=r"^engine name ") as caught:
        SleepController(FakeMemory(TAGS), log=where, engine=engine, rank=0)
    text = str(caught.value)
    assert repr(engine)[:40] in text  # the name, escaped
    named = "names no file" if (engine, log) == ("", "directory") else rule  # the log directory's rule speaks first
    assert text.startswith("engine name ") and named in text, text
    assert "printable" in text or named != rule, text
    assert "\n" not in text and "\r" not in text  # the name is shown escaped, never raw
    assert not any(tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))


@pytest.mark.parametrize("engine", ACCEPTED)
def test_a_printable_name_within_the_limit_is_taken_as_it_is(tmp_path: Path, engine: str) -> None:
    """Non-ASCII letters, quotes, slashes (without a log directory) and inner spaces are taken, and recorded unchanged."""
    ctl = SleepController(FakeMemory(TAGS), log=tmp_path / "e.jsonl", engine=engine, rank=0)
    ctl.sleep(1)
    assert ctl.projection.engine == engine and {e.engine for e in ctl.events()} == {engine}
    assert check_engine_name(engine) == engine


def test_the_vllm_setting_is_checked_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORPOR_ENGINE holding a newline is refused naming the variable, before any controller or keeper sees it."""
    monkeypatch.setenv(ENV_ENGINE, "vllm\nforged")
    with pytest.raises(ValueError, match=rf"\${ENV_ENGINE}.*U\+000A"):
        engine_name()
    monkeypatch.setenv(ENV_ENGINE, "模型")
    assert engine_name() == "模型"


def test_a_name_that_is_no_str_is_a_type_error() -> None:
    """An engine given as bytes or an int is a TypeError naming its type."""
    for engine in (b"llm", 7, None):
        with pytest.raises(TypeError, match="engine must be a str"):
            check_engine_name(engine)
