"""torpor demo: the whole product on one screen, on a GPU or on the simulated device."""

from __future__ import annotations
