"""Environment variables read one way everywhere: every ``TORPOR_*`` variable, and the foreign ones torpor reads (``RANK``).

One reader per type: on/off (:func:`env_switch`), a rank (:func:`env_rank`), seconds
(:func:`env_seconds`), text (:func:`env_text`) and a path (:func:`env_path`). A value a
reader cannot read is refused with a :class:`~torpor.errors.BadSetting` (a ValueError)
naming the variable: never read as a default. tests/test_architecture.py checks that no
other module reads a ``TORPOR_*`` variable itself.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

from torpor.errors import BadSetting

__all__ = ["env_path", "env_rank", "env_seconds", "env_switch", "env_text"]

_ON = ("1", "true", "on")
_OFF = ("0", "false", "off")
#: What ``int()`` reads as a whole number 0 or more, in ASCII digits only (no ``_``, no other scripts' digits).
_RANK = re.compile(r"\+?[0-9]+")


def env_text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of variable ``name`` as it is set; None when unset or empty."""
    return (os.environ if environ is None else environ).get(name) or None


def env_path(name: str, environ: Mapping[str, str] | None = None) -> Path | None:
    """The path variable ``name`` names (a directory, a file, a socket); None when unset or empty."""
    text = env_text(name, environ)
    return None if text is None else Path(text)


def env_switch(name: str, environ: Mapping[str, str] | None = None, *, default: bool = True) -> bool:
    """Whether switch ``name`` is on: ``1``/``true``/``on``; off for ``0``/``false``/``off``; unset or empty: ``default``.

    Any case, spaces around. Any other value is refused with a :class:`~torpor.errors.BadSetting` (a ValueError)
    naming the variable (a typo is never read as on or off).
    """
    value = (env_text(name, environ) or "").strip().lower()
    if not value:
        return default
    if value not in _ON + _OFF:
        raise BadSetting(name, value, "a switch (use 1 or 0)")
    return value in _ON


def env_rank(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The rank in variable ``name`` (``RANK``, ``TORPOR_RANK``): None when unset or blank.

    Read as ``int()`` reads a whole number (spaces around, a leading ``+``), in
    ASCII digits; a negative or anything else is refused with a :class:`~torpor.errors.BadSetting`
    (a ValueError) naming the variable, where reading it as 0 would put two ranks in one log.
    """
    raw = env_text(name, environ)
    if raw is None or not raw.strip():
        return None
    if not _RANK.fullmatch(raw.strip()):
        raise BadSetting(name, raw, "a rank (a whole number, 0 or more)")
    return int(raw)


def env_seconds(name: str, environ: Mapping[str, str] | None = None, *, default: float) -> float:
    """The number of seconds in variable ``name`` (finite, 0 or more; spaces around): ``default`` when unset or blank.

    ``nan``, ``inf``, a negative or no number at all is refused with a
    :class:`~torpor.errors.BadSetting` naming the variable.
    """
    raw = (env_text(name, environ) or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise BadSetting(name, raw, "a number of seconds (finite, 0 or more)")
    return value
