"""Tests for torpor.telemetry.feed: the /events headers carry the engine name encoded, never raw, on a running endpoint."""

from __future__ import annotations

import contextlib
import re
import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torpor import SleepController
from torpor.client import Client
from torpor.statemachine.core.events import Event
from torpor.statemachine.core.fields import thaw
from torpor.statemachine.log.codec import encode_line
from torpor.telemetry import Server, serve
from torpor.telemetry.feed import Batch, decode_header_value, events_headers
from torpor.testing import FakeMemory

TAGS = {"weights": 4000, "kv_cache": 8000}
#: A name a hostile log can carry: a CR/LF would end the header and start a forged one.
HOSTILE = "e\r\nSet-Cookie: stolen=1\r\nX-Forged: 1"
_VISIBLE = re.compile(r"[\x21-\x7e]*")


def answer(server: Server, target: str) -> tuple[bytes, list[bytes], bytes]:
    """GET ``target`` over a raw socket (closing): the status line, the header lines, the body (empty: no answer)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        got = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    return status, lines, body


def header(lines: list[bytes], name: bytes) -> list[bytes]:
    """The values of every header line named ``name`` (case-insensitive)."""
    return [line.partition(b":")[2].strip() for line in lines if line.partition(b":")[0].lower() == name.lower()]


@pytest.fixture
def hostile_log(tmp_path: Path) -> Path:
    """A log whose events name the engine ``HOSTILE`` (as a hand-written or tampered file can)."""
    path = tmp_path / "hostile.jsonl"
    ctl = SleepController(FakeMemory(TAGS), log=tmp_path / "good.jsonl", engine="e", rank=0)
    ctl.sleep(1)
    events = ctl.events()
    ctl.close()
    forged = [Event(e.kind, e.seq, e.wall, e.mono, e.pid, HOSTILE, e.rank, thaw(e.data)) for e in events]
    path.write_bytes(b"".join(encode_line(e) for e in forged))
    return path


@pytest.fixture
def unicode_server() -> Iterator[Server]:
    """An endpoint serving a controller whose engine is named '模型-0'."""
    ctl = SleepController(FakeMemory(TAGS), engine="模型-0", rank=0)
    ctl.sleep(1)
    with serve(ctl, 0) as srv:
        yield srv


def test_an_engine_named_outside_ascii_is_answered_and_followed(unicode_server: Server) -> None:
    """/events of engine '模型-0' answers 200 with the name percent-encoded (UTF-8); the client reads it back."""
    status, lines, body = answer(unicode_server, "/events")
    assert status.startswith(b"HTTP/1.1 200 "), (status, lines)
    assert header(lines, b"X-Torpor-Engine") == [b"%E6%A8%A1%E5%9E%8B-0"]
    assert body.count(b"\n") >= 2
    client = Client(unicode_server.url)
    assert [e.kind.value for e in client.events()][:2] == ["opened", "sleep_requested"]
    assert client.served_engine == "模型-0"
    assert Client(unicode_server.url, engine="模型-0").events(limit=1)[0].engine == "模型-0"


def test_a_hostile_log_cannot_inject_a_header(hostile_log: Path) -> None:
    """serve(path) of a log whose engine name holds CR/LF: one X-Torpor-Engine, encoded, and no forged header line."""
    with serve(hostile_log, 0) as srv:
        status, lines, _ = answer(srv, "/events")
        client = Client(srv.url)
        events = client.events()
    assert status.startswith(b"HTTP/1.1 200 "), (status, lines)
    assert header(lines, b"Set-Cookie") == [] and header(lines, b"X-Forged") == []
    assert header(lines, b"X-Torpor-Engine") == [b"e%0D%0ASet-Cookie:%20stolen=1%0D%0AX-Forged:%201"]
    assert all(_VISIBLE.fullmatch(line.decode("latin-1").replace(" ", "")) for line in lines), lines
    assert client.served_engine == HOSTILE and events[0].engine == HOSTILE


def test_every_header_line_of_every_route_is_visible_ascii(hostile_log: Path) -> None:
    """/events, /state and /metrics of a hostile log: every header line is visible ASCII and spaces, none forged."""
    with serve(hostile_log, 0) as srv:
        for target in ("/events", "/events?after=1&limit=1", "/state", "/metrics", "/nope"):
            status, lines, _ = answer(srv, target)
            assert status.startswith(b"HTTP/1.1 "), (target, status)
            assert all(_VISIBLE.fullmatch(line.decode("latin-1").replace(" ", "")) for line in lines), (target, lines)
            assert header(lines, b"Set-Cookie") == [], target


@given(st.text(max_size=40) | st.text(st.characters(codec=None), max_size=8))
def test_an_engine_header_value_is_visible_ascii_and_decodes_back(engine: str) -> None:
    """Any name (controls, '%', spaces, lone surrogates from a log) becomes visible ASCII that decodes to the name itself."""
    value = events_headers(Batch(b"", 0, None, 7), engine, 3)["X-Torpor-Engine"]
    assert _VISIBLE.fullmatch(value), value
    assert decode_header_value(value) == engine
    if not any(0xD800 <= ord(c) <= 0xDFFF for c in engine):  # plain percent-encoded UTF-8: any client decodes it
        assert urllib.parse.unquote(value, errors="strict") == engine
