"""torpor.allocator (see its issue)."""

from __future__ import annotations
