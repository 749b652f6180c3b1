"""Tests for torpor.telemetry.admission's handler: what it refuses to write, on a running endpoint over a raw socket."""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any

import pytest

from torpor import SleepController
from torpor.telemetry import serve
from torpor.testing import FakeMemory


def test_a_header_value_that_is_no_visible_ascii_is_never_sent(caplog: pytest.LogCaptureFixture) -> None:
    """A route handing _send a raw CR/LF or non-ASCII header value sends nothing (no forged line) and logs why."""
    ctl = SleepController(FakeMemory({"weights": 4000}), engine="e", rank=0)
    with serve(ctl, 0) as srv:
        for value in ("a\r\nSet-Cookie: stolen=1", "模型"):

            def raw(handler: Any, query: str, value: str = value) -> None:
                handler._send(200, b"x", "text/plain", {"X-Raw": value})

            srv.routes["/raw"] = raw
            with (
                caplog.at_level(logging.ERROR, "torpor.telemetry"),
                socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock,
            ):
                sock.sendall(b"GET /raw HTTP/1.1\r\nHost: x\r\n\r\n")
                got = b""
                with contextlib.suppress(OSError):
                    while chunk := sock.recv(65536):
                        got += chunk
            assert got == b"", got
            assert "X-Raw refused: a value must be visible ASCII" in caplog.text
            caplog.clear()
