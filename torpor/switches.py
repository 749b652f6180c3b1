"""On/off environment variables: one reading for all of torpor's switches (``TORPOR_TRIM_FREE_SEGMENTS``, ...)."""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["env_switch"]

_ON = ("1", "true", "on", "")
_OFF = ("0", "false", "off")


def env_switch(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether switch ``name`` is on: unset, empty, ``1``/``true``/``on``; off for ``0``/``false``/``off``; ValueError naming it otherwise."""
    value = (os.environ if environ is None else environ).get(name, "1").strip().lower()
    if value not in _ON + _OFF:
        msg = f"{name}={value!r} is not a switch (use 1 or 0)"
        raise ValueError(msg)
    return value in _ON
