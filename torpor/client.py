"""A small HTTP client for RL controllers: read a rank's state and long-poll its events from either endpoint.

It talks to the standalone endpoint (``serve(controller_or_log, port)``:
``/state``, ``/events``) and to vLLM's API server with torpor's endpoint
plugin (``VLLM_PLUGINS=torpor``: ``/torpor/state``, ``/torpor/events``); both
answer ``/events`` the same way (:mod:`torpor.telemetry.feed`). It needs only
the standard library (no torch, no HTTP package) and changes nothing on the
server::

    from torpor.client import Client

    engine = Client("http://127.0.0.1:8000", rank=0)    # vllm serve ... with VLLM_PLUGINS=torpor
    engine.wait_for("asleep_l1", timeout=120)          # after POST /sleep?level=1
    for event in engine.follow(after=engine.last_seq):  # long-polls, resumes where it left
        print(event.seq, event.kind)

Errors: :class:`~torpor.errors.EndpointError` (the server refused or could
not answer: its status and reason), :class:`~torpor.errors.StateTimeout`
(``wait_for`` ran out of time: the state it saw last).
"""

from __future__ import annotations

import email.utils
import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from torpor.errors import BadArgument, EndpointError, StateTimeout
from torpor.statemachine.core.events import Event
from torpor.statemachine.core.states import ASLEEP, State
from torpor.statemachine.core.timeouts import timeout_seconds

logger = logging.getLogger("torpor.client")

#: Longest long-poll the endpoints grant (seconds); longer waits are made of several polls.
MAX_POLL = 30.0
#: ``wait_for`` targets beyond the state names: ``asleep`` is either level.
ASLEEP_STATES = frozenset(s.value for s in ASLEEP)
#: What readers call a log whose engine closed its controller (``/state``, ``torpor status``).
CLOSED = "closed"
#: Longest single pause a busy answer (503/429 with ``Retry-After``) makes the client take.
MAX_RETRY_PAUSE = 5.0


class Client:
    """Reads one rank of one engine through an endpoint at ``url`` (``http://host:port``).

    ``engine`` picks the engine when a vLLM log directory holds several (None:
    the only one); ``rank`` the rank (None: the only one, or rank 0). ``prefix`` is ``""`` for the
    standalone endpoint and ``"/torpor"`` for the vLLM route; None finds out
    with one request. ``timeout`` bounds each request beyond its long-poll.
    ``busy_timeout`` is how long, in all, one request rides out a busy endpoint
    (503 or 429 with ``Retry-After``: it waits as told, at most
    :data:`MAX_RETRY_PAUSE` at a time, and asks again); 0 raises at once.
    """

    def __init__(
        self,
        url: str,
        *,
        engine: str | None = None,
        rank: int | None = None,
        prefix: str | None = None,
        timeout: float = 10.0,
        busy_timeout: float = 30.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.engine = engine
        self.rank = rank
        self.timeout = timeout
        self.busy_timeout = busy_timeout
        self._prefix = prefix
        #: The newest sequence number the server reported (``X-Torpor-Last-Seq``, or ``/state``).
        self.last_seq = 0
        #: How often :meth:`follow` found the log started anew (its last event below the one followed).
        self.restarts = 0
        self._server_seq: int | None = None  # X-Torpor-Last-Seq of the last /events answer
        #: The engine the last ``/events`` answer came from (``X-Torpor-Engine``, percent-decoded), None before one.
        self.served_engine: str | None = None

    # -- requests -------------------------------------------------------------------

    def _get(self, path: str, params: dict[str, Any], wait: float = 0.0) -> tuple[bytes, dict[str, str]]:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.url}{path}" + (f"?{query}" if query else "")
        request = urllib.request.Request(url, headers={"Accept": "application/json, application/x-ndjson"})  # noqa: S310
        busy_until: float | None = None
        while True:
            try:
                with urllib.request.urlopen(request, timeout=self.timeout + wait) as response:  # noqa: S310
                    return response.read(), {k.lower(): v for k, v in response.headers.items()}
            except urllib.error.HTTPError as exc:
                body = exc.read()
                pause = _retry_after(exc.headers.get("Retry-After")) if exc.code in (429, 503) else None
                if pause is not None:
                    now = time.monotonic()
                    busy_until = now + self.busy_timeout if busy_until is None else busy_until
                    if now < busy_until:
                        logger.info("%s answered %d (busy); asking again in %.2f s", url, exc.code, pause)
                        time.sleep(min(pause, MAX_RETRY_PAUSE, busy_until - now))
                        continue
                    why = f"{_reason(body)} (still busy after {self.busy_timeout:g} s of retries)"
                    raise EndpointError(url, exc.code, why) from None
                raise EndpointError(url, exc.code, _reason(body)) from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise EndpointError(url, None, f"cannot reach the endpoint: {reason}") from None

    @property
    def prefix(self) -> str:
        """The routes' prefix: ``""`` (standalone endpoint) or ``"/torpor"`` (vLLM API server)."""
        if self._prefix is None:
            try:
                self._get("/events", {"limit": 1})
                self._prefix = ""
            except EndpointError as exc:
                if exc.status != 404:
                    raise
                self._prefix = "/torpor"  # vLLM's API server: its own routes, torpor's under /torpor
        return self._prefix

    # -- state ----------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The rank's state as the server reports it: ``state``, ``last_seq``, ``residency``, ``level``..."""
        body, _ = self._get(f"{self.prefix}/state", {"engine": self.engine} if self.prefix else {})
        raw = json.loads(body)
        if not self.prefix:
            found: dict[str, Any] = raw
            _check_identity(found, self.engine, self.rank, f"{self.url}/state")
        else:
            found = _rank_of(raw, self.engine, self.rank, self.url)
        self.last_seq = max(self.last_seq, int(found.get("last_seq") or 0))
        return found

    def state(self) -> str:
        """The rank's state now (``awake``, ``asleep_l1``, ``partially_awake``..., ``closed`` once its log closed)."""
        return str(self.status()["state"])

    def wait_for(self, state: str | State, timeout: float = 300.0) -> dict[str, Any]:
        """Block until the rank is in ``state`` (``asleep`` matches either level, ``closed`` a closed log); return its status.

        It long-polls the rank's events and reads the state again after each
        one, so it returns within a request's time of the transition and
        costs nothing while nothing happens. Raises
        :class:`~torpor.errors.StateTimeout` after ``timeout`` seconds (finite,
        >= 0: ``nan``, ``inf`` or a negative number is a ``ValueError`` at once).
        """
        timeout_seconds(timeout, refused=f" (nothing was asked of {self.url})")  # nan passed every comparison
        want = state.value if isinstance(state, State) else str(state)
        if want not in ("asleep", CLOSED) and want not in {s.value for s in State}:
            msg = f"unknown state {want!r}; states: asleep, {', '.join(s.value for s in State)}, {CLOSED}"
            raise BadArgument(msg)
        wanted = ASLEEP_STATES if want == "asleep" else frozenset({want})
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status["state"] in wanted:
                return status
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StateTimeout(want, str(status["state"]), timeout, self.url)
            self.events(after=int(status.get("last_seq") or 0), wait=min(remaining, MAX_POLL), limit=1)

    # -- events ---------------------------------------------------------------------

    def events(self, after: int = 0, *, wait: float = 0.0, limit: int | None = None) -> list[Event]:
        """The rank's events above ``after`` (oldest first); with ``wait``, up to that long for a first one."""
        params: dict[str, Any] = {"after": after, "limit": limit, "engine": self.engine}
        if self.rank is not None:
            params["rank"] = self.rank
        if wait > 0:
            params["wait"] = f"{min(wait, MAX_POLL):.3f}"
        body, headers = self._get(f"{self.prefix}/events", params, wait)
        if "x-torpor-last-seq" in headers:
            self._server_seq = int(headers["x-torpor-last-seq"])
            self.last_seq = max(self.last_seq, self._server_seq)
        if "x-torpor-engine" in headers:  # percent-encoded UTF-8 (torpor.telemetry.feed.encode_header_value)
            self.served_engine = urllib.parse.unquote(headers["x-torpor-engine"], errors="surrogatepass")
        events = []
        for line in body.splitlines():
            try:
                events.append(Event.from_dict(json.loads(line)))
            except ValueError as exc:
                raise EndpointError(f"{self.url}{self.prefix}/events", 200, f"unreadable event line: {exc}") from None
        return events

    def follow(self, after: int = 0, *, poll: float = MAX_POLL, idle_timeout: float | None = None) -> Iterator[Event]:
        """Yield the rank's events above ``after`` as they happen (long-polls of ``poll`` seconds).

        Ends after ``idle_timeout`` seconds without an event (None: never). A
        gap (events that left the server's recent window before they were
        read) is logged as a warning, and following goes on. A log started
        anew (a new engine on the same path: its last event below ``after``)
        is logged as a warning, counted in :attr:`restarts`, and followed from
        its event #1: the next event yielded has a lower ``seq`` than the last.
        It is seen within one poll, while the new log is still shorter than
        the old one was where this follower stood.
        """
        quiet_since = time.monotonic()
        while True:
            wait = poll if idle_timeout is None else max(0.0, min(poll, quiet_since + idle_timeout - time.monotonic()))
            self._server_seq = None
            batch = self.events(after, wait=wait)
            if not batch and after and self._server_seq is not None and self._server_seq < after:
                logger.warning(
                    "%s: the log started anew (its last event is #%d, below #%d): following the new log from #1",
                    self.url,
                    self._server_seq,
                    after,
                )
                self.restarts += 1
                self.last_seq = self._server_seq
                after = 0
                continue
            if batch:
                if batch[0].seq > after + 1 and after:
                    logger.warning(
                        "%s: events #%d..#%d were not kept by the server", self.url, after + 1, batch[0].seq - 1
                    )
                quiet_since = time.monotonic()
                for event in batch:
                    after = event.seq
                    yield event
            elif idle_timeout is not None and time.monotonic() - quiet_since >= idle_timeout:
                return


def _reason(body: bytes) -> str:
    try:
        raw = json.loads(body)
    except ValueError:
        return body[:200].decode(errors="replace")
    if isinstance(raw, dict):
        return str(raw.get("error") or raw.get("detail") or raw)
    return str(raw)


def _retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date); None when absent or unreadable."""
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.05), MAX_RETRY_PAUSE)


def _check_identity(found: dict[str, Any], engine: str | None, rank: int | None, url: str) -> None:
    """The standalone endpoint serves one rank: asking it for another is refused, as ``/events`` refuses it."""
    if rank is not None and found.get("rank") != rank:
        raise EndpointError(url, 200, f"this endpoint serves rank {found.get('rank')}, not rank {rank}")
    if engine is not None and found.get("engine") != engine:
        raise EndpointError(url, 200, f"this endpoint serves engine {found.get('engine')!r}, not {engine!r}")


def _rank_of(fleet: dict[str, Any], engine: str | None, rank: int | None, url: str) -> dict[str, Any]:
    """The rank's entry of a ``/torpor/state`` answer (every engine of a log directory, merged)."""
    engines = fleet.get("engines") or []
    if engine is not None:
        engines = [e for e in engines if e.get("engine") == engine]
    if len(engines) != 1:
        names = ", ".join(str(e.get("engine")) for e in fleet.get("engines") or []) or "none"
        raise EndpointError(
            f"{url}/torpor/state",
            200,
            f"name one engine of: {names}" if engines else f"no engine {engine!r}; engines: {names}",
        )
    ranks = engines[0].get("ranks") or []
    if rank is None:
        rank = ranks[0].get("rank") if len(ranks) == 1 else 0
    for entry in ranks:
        if entry.get("rank") == rank:
            result: dict[str, Any] = entry
            return result
    raise EndpointError(f"{url}/torpor/state", 200, f"engine {engines[0].get('engine')!r} has no rank {rank}")
