"""What every ``/events`` route serves from: a source's recent events, encoded once, and a wake-up for long-polls.

One :class:`EventFeed` per source (a live controller, or a :class:`~torpor.statemachine.log.logsource.LogSource`
following a log). It keeps its own copy of the last ``keep`` events, fed by the
source's subscription, so a reader never takes the engine's lock to list
events; each event's JSON line is encoded the first time a reader asks for it
and kept, so a client pulling 10,000 events costs a lookup and a join, not
10,000 encodings under the GIL the engine needs (and readers pulling the same
window share one join). Long-polls wait on
:meth:`EventFeed.waker`: a pipe whose write end is closed at the next event,
so every waiting reader wakes at once and a waiting thread can also watch its
client's socket (a hang-up frees its slot at once).

Both endpoints (the standalone one and the vLLM route) answer ``/events`` the
same way (:data:`EVENTS_PARAMS`): NDJSON, one event per line as the log writes
it (without the checksum), oldest first, and headers ``X-Torpor-Last-Seq``
(the newest event's number), ``X-Torpor-First-Seq`` (the first returned),
``X-Torpor-Engine`` and ``X-Torpor-Rank``.

``X-Torpor-Engine`` is the engine name percent-encoded as UTF-8
(:func:`encode_header_value`): visible ASCII but ``%`` as it is, every other
character (a space, ``%``, a control character, anything beyond ASCII) as
``%XX`` bytes, so ``模型-0`` goes out as ``%E6%A8%A1%E5%9E%8B-0`` and a name
holding CR/LF (a hostile log given to ``serve(path)``) can never end the header
and forge another. ``urllib.parse.unquote`` reads it back
(:func:`decode_header_value`; :class:`torpor.client.Client` does).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from urllib.parse import parse_qsl, quote, unquote

from torpor.errors import BadRequest
from torpor.statemachine.core.events import Event
from torpor.telemetry.tracker import Source

#: The query parameters of ``/events`` on both endpoints.
EVENTS_PARAMS = ("engine", "rank", "after", "limit", "wait")
NDJSON = "application/x-ndjson"
_SEQ = attrgetter("seq")
#: What a header value keeps as it is: visible ASCII (RFC 9110 field-vchar) but ``%``, the escape itself.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def encode_header_value(text: str) -> str:
    """``text`` as a response header value: visible ASCII kept, anything else percent-encoded UTF-8 (never CR/LF).

    Lossless for every ``str``: a lone surrogate (a JSON ``\\ud800`` in a log) is encoded as its three bytes.
    """
    return quote(text, safe=_HEADER_SAFE, errors="surrogatepass")


def decode_header_value(value: str) -> str:
    """The text :func:`encode_header_value` encoded (``urllib.parse.unquote``; what a client reads back)."""
    return unquote(value, errors="surrogatepass")


def int_param(params: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    """The integer query parameter ``name`` within ``low..high`` (``default`` when absent), else :class:`BadRequest`."""
    raw = params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit()):  # str.isdigit alone takes "²", which int() refuses
        msg = f"{name} must be a non-negative integer, got {raw[:40]!r}"
        raise BadRequest(msg)
    digits = raw.lstrip("0") or "0"
    if len(digits) > len(str(high)):  # beyond the range; and int() refuses over 4300 digits
        msg = f"{name} must be between {low} and {high}, got {raw[:40]}{'...' if len(raw) > 40 else ''}"
        raise BadRequest(msg)
    value = int(digits)
    if not low <= value <= high:
        msg = f"{name} must be between {low} and {high}, got {value}"
        raise BadRequest(msg)
    return value


def seconds_param(params: Mapping[str, str], name: str, default: float, high: float) -> float:
    """The seconds query parameter ``name`` within ``0..high`` (``default`` when absent), else :class:`BadRequest`."""
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        msg = f"{name} must be a number of seconds, got {raw[:40]!r}"
        raise BadRequest(msg) from None
    if not 0.0 <= value <= high:  # also refuses nan
        msg = f"{name} must be between 0 and {high:g} seconds, got {raw[:40]!r}"
        raise BadRequest(msg)
    return value


def parse_query(query: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """Query parameters as a dict; unknown, repeated or malformed ones raise :class:`BadRequest`."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query), max_num_fields=len(allowed) + 1)
    except ValueError as exc:
        msg = f"malformed query string ({exc})"
        raise BadRequest(msg) from None
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in allowed:
            known = ", ".join(allowed) or "none"
            msg = f"unknown query parameter {name[:40]!r}; this route takes: {known}"
            raise BadRequest(msg)
        if name in params:
            msg = f"query parameter {name!r} given more than once"
            raise BadRequest(msg)
        params[name] = value
    return params


@dataclass(frozen=True)
class EventsQuery:
    """A parsed ``/events`` query: ``engine`` and ``rank`` (None: the only one), ``after``, ``limit``, ``wait``."""

    engine: str | None
    rank: int | None
    after: int
    limit: int
    wait: float


def events_query(params: Mapping[str, str], *, max_wait: float, max_events: int) -> EventsQuery:
    """Parse the ``/events`` parameters (:data:`EVENTS_PARAMS`); a bad one raises :class:`BadRequest`."""
    unknown = sorted(set(params) - set(EVENTS_PARAMS))
    if unknown:
        msg = f"unknown query parameter(s) {', '.join(n[:40] for n in unknown)}; /events takes: {', '.join(EVENTS_PARAMS)}"
        raise BadRequest(msg)
    return EventsQuery(
        engine=params.get("engine") or None,
        rank=int_param(params, "rank", 0, 0, 1 << 20) if "rank" in params else None,
        after=int_param(params, "after", 0, 0, 2**63 - 1),
        limit=int_param(params, "limit", max_events, 1, max_events),
        wait=seconds_param(params, "wait", 0.0, max_wait),
    )


class Waker:
    """One generation of the feed's wake-up: :attr:`fd` becomes readable (EOF) at the next event."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        self._lock = threading.Lock()

    def fire(self) -> None:
        """Make :attr:`fd` readable for every waiter (close the write end)."""
        with self._lock:
            if self._write >= 0:
                os.close(self._write)
                self._write = -1

    def __del__(self) -> None:  # the last waiter holding it is gone
        self.fire()
        os.close(self.fd)


@dataclass(frozen=True)
class Batch:
    """Events answered to one ``/events`` request: their NDJSON ``body``, first and newest sequence numbers."""

    body: bytes
    count: int
    first: int | None
    latest: int


def events_headers(batch: Batch, engine: str, rank: int) -> dict[str, str]:
    """The ``X-Torpor-*`` headers of an ``/events`` answer, alike on both endpoints (the engine name encoded)."""
    headers = {
        "X-Torpor-Last-Seq": str(batch.latest),
        "X-Torpor-Engine": encode_header_value(engine),
        "X-Torpor-Rank": str(int(rank)),
    }
    if batch.first is not None:
        headers["X-Torpor-First-Seq"] = str(batch.first)
    return headers


class EventFeed:
    """The last ``keep`` events of ``source``, their JSON lines cached, and a :class:`Waker` for long-polls."""

    def __init__(self, source: Source, keep: int = 10_000) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._lines: list[bytes | None] = []
        self._trimmed = 0  # events dropped from the front so far (cache slots shift by this)
        self.latest = 0
        self.closed = False
        self._waker: Waker | None = None
        self._last_body: tuple[tuple[int, int, int], bytes] | None = None  # the last batch's body, by window
        self._unsubscribe = source.subscribe(self._on_event)
        seed = source.events(0)
        with self._lock:
            first = self._events[0].seq if self._events else None
            older = [e for e in seed if first is None or e.seq < first][-keep:]
            self._events[:0] = older
            self._lines[:0] = [None] * len(older)
            if self._events:
                self.latest = max(self.latest, self._events[-1].seq)
            self.latest = max(self.latest, source.projection.last_seq)

    def _on_event(self, event: Event) -> None:
        """The source's subscriber (runs on the engine's thread): append, and wake the waiters. Nothing more."""
        with self._lock:
            if self._events and event.seq <= self._events[-1].seq:
                if event.seq != 1:
                    return  # seen already
                self._events.clear()  # a log started anew: follow the new one
                self._lines.clear()
                self._last_body = None
            self._events.append(event)
            self._lines.append(None)
            self.latest = event.seq
            if len(self._events) >= 2 * self.keep:
                drop = len(self._events) - self.keep
                del self._events[:drop], self._lines[:drop]
                self._trimmed += drop
            waker, self._waker = self._waker, None
        if waker is not None:
            waker.fire()

    def batch(self, after: int, limit: int) -> Batch:
        """Up to ``limit`` kept events above ``after``, oldest first, as NDJSON."""
        with self._lock:
            start = bisect.bisect_right(self._events, after, key=_SEQ)
            events = self._events[start : start + limit]
            trimmed, latest = self._trimmed, self.latest
            if not events:
                return Batch(b"", 0, None, latest)
            key = (trimmed + start, len(events), events[-1].seq)
            cached = self._last_body
            if cached is not None and cached[0] == key:  # readers pulling the same window: one join for all
                return Batch(cached[1], len(events), events[0].seq, latest)
            lines = self._lines[start : start + limit]
        missing = [i for i, line in enumerate(lines) if line is None]
        if missing:
            for i in missing:
                lines[i] = (events[i].to_json() + "\n").encode()
            with self._lock:
                shift = self._trimmed - trimmed
                for i in missing:
                    slot = start + i - shift
                    if 0 <= slot < len(self._events) and self._events[slot] is events[i]:
                        self._lines[slot] = lines[i]
        body = b"".join(lines)  # type: ignore[arg-type]
        self._last_body = (key, body)
        return Batch(body, len(events), events[0].seq, latest)

    def waker(self, after: int) -> Waker | None:
        """A waker that fires at the next event, or None when an event above ``after`` exists (or the feed closed)."""
        with self._lock:
            if self.closed or self.latest > after:
                return None
            if self._waker is None:
                self._waker = Waker()
            return self._waker

    def close(self) -> None:
        """Stop following the source and wake every waiter."""
        self._unsubscribe()
        with self._lock:
            self.closed = True
            waker, self._waker = self._waker, None
        if waker is not None:
            waker.fire()
