"""An ``/events`` long-poll's wait: for the feed's next event, while watching the client for a hang-up.

The wait ends when an event above ``after`` arrives, when its seconds run
out, when the source is stuck (nothing newer can come), or, returning False,
when the client closes its end: a hung-up long-poll frees its slot at once
instead of holding it for the rest of its wait. ``poll`` rather than
``select``, whose ``FD_SETSIZE`` a busy server's descriptors pass; a hang-up is
``POLLRDHUP`` on Linux, a readable socket with nothing to read elsewhere.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable

from torpor.telemetry.feed import EventFeed

_POLLRDHUP: int = getattr(select, "POLLRDHUP", 0)  # Linux: the peer closed its end; elsewhere a peek tells


def hung_up(connection: socket.socket) -> bool:
    """True when the client closed its end of ``connection`` (a readable socket with nothing to read)."""
    try:
        peeked: bytes = connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    return peeked == b""


def wait_for_event(
    feed: EventFeed, after: int, wait: float, connection: socket.socket, stuck: Callable[[], bool]
) -> bool:
    """Wait for an event above ``after`` (or ``wait`` seconds, or until ``stuck()``); False when the client hung up."""
    deadline = time.monotonic() + wait
    watch_client = True
    while (waker := feed.waker(after)) is not None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return True
        poller = select.poll()
        poller.register(waker.fd, select.POLLIN)
        client = connection.fileno()
        if watch_client:
            poller.register(client, select.POLLIN | _POLLRDHUP)
        ready = dict(poller.poll(remaining * 1000.0))
        if client in ready and watch_client:
            if ready[client] & (_POLLRDHUP | select.POLLHUP | select.POLLERR) or hung_up(connection):
                return False
            watch_client = False  # it sent more (a pipelined request): stop watching, it is not a hang-up
        if not ready:
            return True
        if stuck():
            return True
    return True
