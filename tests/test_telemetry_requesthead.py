"""Tests for torpor.telemetry.requesthead: request framing a running endpoint refuses, over raw sockets (no smuggling)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest

from torpor import SleepController
from torpor.telemetry import Server, serve
from torpor.testing import FakeMemory

#: A second request hidden where a body would be: answering it (404) is request smuggling.
SMUGGLED = b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"


@pytest.fixture
def server() -> Iterator[Server]:
    """An endpoint serving a controller on a free loopback port."""
    controller = SleepController(FakeMemory({"weights": 4000, "kv_cache": 8000}), engine="e", rank=0)
    with serve(controller, 0) as srv:
        yield srv


def exchange(server: Server, data: bytes, timeout: float = 3.0) -> tuple[bytes, bool]:
    """Send ``data`` on a fresh connection; what came back, and whether the server closed within ``timeout``."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        out, closed, deadline = b"", False, time.monotonic() + timeout
        with contextlib.suppress(TimeoutError):
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    closed = True
                    break
                if not chunk:
                    closed = True
                    break
                out += chunk
        return out, closed


def head(target: bytes, *lines: bytes, method: bytes = b"GET") -> bytes:
    """A request head for ``target`` with ``lines`` as its header lines."""
    return method + b" " + target + b" HTTP/1.1\r\nHost: x\r\n" + b"".join(line + b"\r\n" for line in lines) + b"\r\n"


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (head(b"/state", b"Content-Length: %d" % len(SMUGGLED)) + SMUGGLED, "body"),
        (head(b"/state", b"Content-Length: %d" % len(SMUGGLED), method=b"HEAD") + SMUGGLED, "body"),
        (head(b"/state", b"Content-Length: 0", b"Content-Length: %d" % len(SMUGGLED)) + SMUGGLED, "Content-Length"),
        (head(b"/state", b"Content-Length: %d" % len(SMUGGLED), b"Content-Length: 0") + SMUGGLED, "Content-Length"),
        (head(b"/state", b"Content-Length: 0, %d" % len(SMUGGLED)) + SMUGGLED, "Content-Length"),
        (head(b"/state", b"Content-Length: +%d" % len(SMUGGLED)) + SMUGGLED, "Content-Length"),
        (
            head(b"/state", b"Transfer-Encoding: chunked") + b"%x\r\n" % len(SMUGGLED) + SMUGGLED + b"\r\n0\r\n\r\n",
            "Transfer-Encoding",
        ),
        (
            head(b"/state", b"Transfer-Encoding: chunked", b"Content-Length: 5") + b"0\r\n\r\n" + SMUGGLED,
            "Transfer-Encoding",
        ),
        (head(b"/state", b"Content-Length : %d" % len(SMUGGLED)) + SMUGGLED, "whitespace"),
        (head(b"/state", b"X-Pad: a", b" Content-Length: %d" % len(SMUGGLED)) + SMUGGLED, "folded"),
    ],
    ids=[
        "GET with a body",
        "HEAD with a body",
        "two Content-Lengths, 0 first",
        "two Content-Lengths, 0 second",
        "a list of lengths",
        "a signed length",
        "chunked",
        "chunked and a length",
        "space before the colon",
        "a folded header line",
    ],
)
def test_a_request_whose_framing_could_hide_another_is_refused_and_closed(
    server: Server, request_bytes: bytes, reason: str
) -> None:
    """A body, Transfer-Encoding, or a conflicting, listed or signed Content-Length gets 400 and a close; the hidden request is never answered."""
    got, closed = exchange(server, request_bytes)
    assert got.startswith(b"HTTP/1.1 400 "), got[:300]
    assert got.count(b"HTTP/1.1 ") == 1, got  # the smuggled GET /nope got no answer of its own
    assert b"\r\nConnection: close\r\n" in got
    assert closed, "the connection stayed open after the refusal"
    if not request_bytes.startswith(b"HEAD "):  # a HEAD answer carries no body, so no reason
        assert reason in json.loads(got.partition(b"\r\n\r\n")[2])["error"]


def test_two_equal_content_lengths_are_refused_too(server: Server) -> None:
    """Two 'Content-Length: 0' lines (equal, no body) are refused: one framing answer per request, never a guess."""
    got, closed = exchange(server, head(b"/state", b"Content-Length: 0", b"Content-Length: 0"))
    assert got.startswith(b"HTTP/1.1 400 "), got[:300]
    assert "Content-Length" in json.loads(got.partition(b"\r\n\r\n")[2])["error"] and closed


def test_a_zero_content_length_is_no_body_and_keeps_the_connection(server: Server) -> None:
    """'Content-Length: 0' on a GET is no body: answered, and a request pipelined behind it is answered as well."""
    got, closed = exchange(server, head(b"/state", b"Content-Length: 0") + SMUGGLED)
    assert got.startswith(b"HTTP/1.1 200 "), got[:300]
    assert b"HTTP/1.1 404 " in got and closed  # the second request was sent as one: it is answered, then closes


def test_a_write_method_with_a_body_still_gets_405_and_a_close(server: Server) -> None:
    """A POST with a body is refused 405 as before, the connection closes, and its body is never read as a request."""
    got, closed = exchange(server, head(b"/state", b"Content-Length: %d" % len(SMUGGLED), method=b"POST") + SMUGGLED)
    assert got.startswith(b"HTTP/1.1 405 "), got[:300]
    assert got.count(b"HTTP/1.1 ") == 1 and closed


def test_expect_100_continue_is_not_invited(server: Server) -> None:
    """'Expect: 100-continue' with a body gets the 400 at once, never a '100 Continue' that invites the body."""
    got, closed = exchange(server, head(b"/state", b"Content-Length: 10", b"Expect: 100-continue"))
    assert got.startswith(b"HTTP/1.1 400 "), got[:300]
    assert b"100 Continue" not in got and closed
