"""One rule for an engine name, checked wherever a name enters torpor: printable, 1 to 200 bytes, no padding.

An engine name travels far: into every event of the log, the log's file name
(``ENGINE.rankN.jsonl`` in a log directory), the keeper's memfd names and its
``status``, a Prometheus label, an HTTP header of ``/events``
(``X-Torpor-Engine``), and the lines ``torpor status`` prints to an operator's
terminal. A CR/LF there forged a header (``Set-Cookie``) and status lines, an
ESC sequence reached the terminal, a right-to-left override or a zero-width
character made two names look alike, and a long name passed ``attach()`` and
then failed the kernel's memfd name limit. So every entry point refuses such a
name at once, naming it and this rule (:func:`check_engine_name`): the
controller (``SleepController(engine=...)``), the vLLM worker's
``$TORPOR_ENGINE``. What leaves is encoded besides (the endpoint's headers),
since a log written elsewhere, or tampered with, may hold anything.

The rule: a ``str`` of 1 to :data:`MAX_ENGINE_NAME` bytes of UTF-8, every
character printable (``str.isprintable``: letters, marks, digits, punctuation,
symbols and the ASCII space; no control, format, separator, surrogate,
private-use or unassigned character), neither starting nor ending with a space.
"""

from __future__ import annotations

import unicodedata

from torpor.errors import BadArgument, BadArgumentType

__all__ = ["ENGINE_NAME_RULE", "MAX_ENGINE_NAME", "check_engine_name", "engine_name_problem", "refusal"]

#: The longest engine name in bytes of UTF-8: its log file ``.ENGINE.rankN.jsonl.lock`` fits a 255-byte file
#: name, and the keeper's memfd names fit the kernel's 249 bytes.
MAX_ENGINE_NAME = 200
#: The rule, as every refusal states it.
ENGINE_NAME_RULE = (
    f"an engine name is 1 to {MAX_ENGINE_NAME} bytes (UTF-8) of printable characters (letters, digits, "
    "punctuation, symbols, inner spaces): no control, format or line-separator character"
)


_KINDS = {
    "Cc": "a control character",
    "Cf": "a format (invisible) character",
    "Cs": "a lone surrogate",
    "Co": "a private-use character",
    "Cn": "an unassigned character",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
    "Zs": "a space other than the ASCII space",
}


def engine_name_problem(engine: str) -> str | None:
    """Why ``engine`` breaks the rule (``"it holds U+000A (a control character) at index 4"``); None when it keeps it."""
    if not engine:
        return "it is empty"
    if not engine.isprintable():
        at, char = next((i, c) for i, c in enumerate(engine) if not c.isprintable())
        kind = _KINDS.get(unicodedata.category(char), "a character that is not printable")
        return f"it holds U+{ord(char):04X} ({kind}) at index {at}"
    if engine[0] == " " or engine[-1] == " ":
        return "it starts or ends with a space"
    size = len(engine.encode("utf-8"))
    if size > MAX_ENGINE_NAME:
        return f"it is {size} bytes of UTF-8, over the {MAX_ENGINE_NAME} bytes an engine name may take"
    return None


def check_engine_name(engine: object, *, source: str = "", refused: str = "") -> str:
    """``engine`` when it keeps the rule; else a ``ValueError`` naming it (escaped), ``source``, what breaks the rule, the rule.

    ``source`` says where the name came from (``"$TORPOR_ENGINE"``); ``refused``
    ends the message with what was not done (``"; nothing was created"``). A
    name that is no ``str`` is a ``TypeError``.
    """
    if type(engine) is not str:
        msg = f"engine must be a str naming the engine, got {type(engine).__name__} {engine!r}{refused}"
        raise BadArgumentType(msg)
    problem = engine_name_problem(engine)
    if problem is not None:
        msg = refusal(engine, problem, ENGINE_NAME_RULE, source=source, refused=refused)
        raise BadArgument(msg)
    return engine


def refusal(engine: str, problem: str, rule: str, *, source: str = "", refused: str = "") -> str:
    """The message refusing ``engine``: the name escaped (and cut at 80 characters), where it came from, why, the rule."""
    shown = repr(engine) if len(engine) <= 80 else f"{engine[:80]!r}... ({len(engine)} characters in all)"
    where = f" (from {source})" if source else ""
    return f"engine name {shown}{where} is refused: {problem}; {rule}{refused}"
