"""torpor.telemetry.longpoll: a long-poll waits for the next event, its seconds or a stuck source, and sees a hang-up."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from torpor import SleepController
from torpor.telemetry.feed import EventFeed
from torpor.telemetry.longpoll import hung_up, wait_for_event
from torpor.testing import FakeMemory


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    server, client = socket.socketpair()
    yield server, client
    server.close()
    client.close()


@pytest.fixture
def fed() -> Iterator[tuple[SleepController, EventFeed]]:
    controller = SleepController(FakeMemory({"weights": 10}))
    feed = EventFeed(controller)
    yield controller, feed
    feed.close()


def test_a_closed_peer_is_a_hang_up_and_an_open_one_is_not(pair: tuple[socket.socket, socket.socket]) -> None:
    """hung_up is False while the client is connected (silent or sending), True once it closed its end."""
    server, client = pair
    assert not hung_up(server)
    client.sendall(b"GET / HTTP/1.1\r\n")
    assert not hung_up(server)
    assert server.recv(64)
    client.close()
    assert hung_up(server)


def test_the_wait_ends_when_its_seconds_run_out(
    pair: tuple[socket.socket, socket.socket], fed: tuple[SleepController, EventFeed]
) -> None:
    """With no event and a connected client, the wait returns True after its seconds, not before."""
    controller, feed = fed
    start = time.monotonic()
    assert wait_for_event(feed, controller.last_seq, 0.2, pair[0], lambda: False)
    assert time.monotonic() - start >= 0.2


def test_the_wait_ends_at_the_next_event(
    pair: tuple[socket.socket, socket.socket], fed: tuple[SleepController, EventFeed]
) -> None:
    """An event above after ends a 30-second wait at once, True."""
    controller, feed = fed
    after = controller.last_seq
    threading.Timer(0.1, controller.sleep, args=(1,)).start()
    start = time.monotonic()
    assert wait_for_event(feed, after, 30.0, pair[0], lambda: False)
    assert time.monotonic() - start < 10
    assert feed.latest > after


def test_a_client_that_hangs_up_ends_the_wait_with_false(
    pair: tuple[socket.socket, socket.socket], fed: tuple[SleepController, EventFeed]
) -> None:
    """A client closing its end during a 30-second wait ends it at once, False (its slot can go back)."""
    controller, feed = fed
    server, client = pair
    threading.Timer(0.1, client.close).start()
    start = time.monotonic()
    assert not wait_for_event(feed, controller.last_seq, 30.0, server, lambda: False)
    assert time.monotonic() - start < 10


def test_a_pipelined_request_is_no_hang_up(
    pair: tuple[socket.socket, socket.socket], fed: tuple[SleepController, EventFeed]
) -> None:
    """A client that sends more while it waits is still waiting: the wait runs its seconds, True."""
    controller, feed = fed
    server, client = pair
    client.sendall(b"GET /state HTTP/1.1\r\n\r\n")
    assert wait_for_event(feed, controller.last_seq, 0.2, server, lambda: False)
