"""torpor.hooks (see its issue)."""

from __future__ import annotations
