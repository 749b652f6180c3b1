"""Content negotiation for ``/metrics``: which exposition format and encoding a scrape gets.

Prometheus sends an ``Accept`` header that prefers OpenMetrics and also
accepts the text format, e.g. (Prometheus 3)::

    application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,
    application/openmetrics-text;version=0.0.1;q=0.5,
    text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,
    text/plain;version=0.0.4;q=0.3,*/*;q=0.2

torpor answers the text format (version 0.0.4) to every request that accepts
it at all (``text/plain`` or ``*/*`` with q > 0, or no ``Accept``): the text
format is rendered directly from the projection (the fast path), Prometheus
parses it fully, and torpor's metrics use nothing only OpenMetrics can carry
(no exemplars). Only a client that accepts OpenMetrics and not the text format
gets OpenMetrics (prometheus_client's encoder). A malformed header (a
non-numeric ``version``, a bad ``q``) is read leniently, never an error.
``Accept-Encoding: gzip`` gets a gzip body.
"""

from __future__ import annotations

import gzip
import math
from typing import NamedTuple

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
#: gzip level for /metrics bodies: level 1 compresses a torpor exposition about 8x, at a fraction of level 9's cost.
GZIP_LEVEL = 1


class Accepted(NamedTuple):
    """A media range from ``Accept``: type, its parameters (lower-cased names) and q."""

    media: str
    params: dict[str, str]
    q: float


def parse_accept(header: str) -> list[Accepted]:
    """The media ranges of an ``Accept`` (or ``Accept-Encoding``) header; junk is skipped, never raised."""
    out: list[Accepted] = []
    for item in header.split(",")[:64]:
        media, *rest = item.split(";")
        media = media.strip().lower()
        if not media:
            continue
        params: dict[str, str] = {}
        q = 1.0
        for raw in rest:
            name, _, value = raw.partition("=")
            name, value = name.strip().lower(), value.strip().strip('"')
            if name == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0  # an unreadable weight: treat the range as not wanted
                q = min(max(q, 0.0), 1.0) if math.isfinite(q) else 0.0
            elif name:
                params[name] = value
        out.append(Accepted(media, params, q))
    return out


def wants_text(accept: str) -> bool:
    """True when the text format is acceptable (the fast path): ``text/plain``, ``text/*``, ``*/*`` or no header."""
    ranges = parse_accept(accept)
    if not ranges:
        return True
    if any(r.media in ("text/plain", "text/*", "*/*") and r.q > 0 for r in ranges):
        return True
    return not any(r.media == "application/openmetrics-text" and r.q > 0 for r in ranges)


def wants_gzip(accept_encoding: str) -> bool:
    """True when ``Accept-Encoding`` takes gzip (q > 0)."""
    return any(r.media in ("gzip", "x-gzip", "*") and r.q > 0 for r in parse_accept(accept_encoding))


def compress(body: bytes) -> bytes:
    """``body`` gzipped at :data:`GZIP_LEVEL` (mtime 0: the same body compresses to the same bytes)."""
    return gzip.compress(body, compresslevel=GZIP_LEVEL, mtime=0)
