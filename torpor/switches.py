"""Environment variables read one way everywhere: on/off switches (``TORPOR_TRIM_FREE_SEGMENTS``, ...) and ranks (``RANK``)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from torpor.errors import BadSetting

__all__ = ["env_rank", "env_switch"]

_ON = ("1", "true", "on")
_OFF = ("0", "false", "off")
#: What ``int()`` reads as a whole number 0 or more, in ASCII digits only (no ``_``, no other scripts' digits).
_RANK = re.compile(r"\+?[0-9]+")


def env_switch(name: str, environ: Mapping[str, str] | None = None, *, default: bool = True) -> bool:
    """Whether switch ``name`` is on: ``1``/``true``/``on``; off for ``0``/``false``/``off``; unset or empty: ``default``.

    Any case, spaces around. Any other value is refused with a :class:`~torpor.errors.BadSetting` (a ValueError) naming
    the variable (a typo is never read as on or off).
    """
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    if not value:
        return default
    if value not in _ON + _OFF:
        raise BadSetting(name, value, "a switch (use 1 or 0)")
    return value in _ON


def env_rank(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The rank in variable ``name`` (``RANK``, ``TORPOR_RANK``): None when unset or blank.

    Read as ``int()`` reads a whole number (spaces around, a leading ``+``), in
    ASCII digits; a negative or anything else is refused with a :class:`~torpor.errors.BadSetting` (a ValueError) naming
    the variable, where reading it as 0 would put two ranks in one log.
    """
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return None
    if not _RANK.fullmatch(raw.strip()):
        raise BadSetting(name, raw, "a rank (a whole number, 0 or more)")
    return int(raw)
