"""Subcommands of the ``torpor`` CLI, one module each (see ``torpor.cli``); :func:`seconds` parses their durations."""

from __future__ import annotations

import argparse
import math


def seconds(text: str) -> float:
    """A number of seconds, finite and >= 0 (``nan`` passed every comparison, so a wait never ended)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        msg = f"{text!r} is not a finite number of seconds >= 0"
        raise argparse.ArgumentTypeError(msg)
    return value
