"""A request head, read within bounds (:func:`read_head`) and checked for framing that could hide a second request.

The endpoint (:mod:`torpor.telemetry.server`) reads no request body: every
route is a GET or HEAD that reads. So a request whose framing says a body
follows, or says it ambiguously, must never keep its connection: behind a
proxy that reads the framing another way, the "body" would be parsed here as
the next request (request smuggling). :func:`framing_problem` names what is
refused, as RFC 9112 asks of a server (sections 2.2, 5.1, 5.2, 6.1 and 6.3):

- a ``Transfer-Encoding`` header (any value: chunked or not, the body's length
  is not ours to guess);
- a ``Content-Length`` that is not one plain number of bytes: given twice
  (equal or not), a list (``0, 35``), signed, or not digits;
- a body on a GET or HEAD (``Content-Length`` above 0): the request itself is
  refused, its body never read (other methods are refused 405 and closed);
- a header line that parsers read differently: whitespace between the name
  and its colon, a folded line (starting with a space or tab), a line without
  a colon, a NUL or a bare CR.

Each gets ``400 Bad Request`` naming the reason, with ``Connection: close``
(:meth:`BoundedHandler <torpor.telemetry.admission.BoundedHandler>`).
``Content-Length: 0`` is no body: the request is answered and the connection kept.
"""

from __future__ import annotations

import re
import socket
import time
from typing import NamedTuple

MAX_REQUEST_LINE = 8192
MAX_HEAD_BYTES = 16384
MAX_HEADERS = 64

OK, CLOSED, TIMEOUT, LINE_TOO_LONG, HEAD_TOO_LARGE, TOO_MANY_HEADERS = range(6)

#: The answer to a head that could not be read whole: status and reason, by :func:`read_head`'s outcome.
HEAD_REFUSED = {
    LINE_TOO_LONG: (414, f"request line over the {MAX_REQUEST_LINE}-byte limit"),
    HEAD_TOO_LARGE: (431, f"request head over the {MAX_HEAD_BYTES}-byte limit"),
    TOO_MANY_HEADERS: (431, f"more than {MAX_HEADERS} header lines"),
    TIMEOUT: (408, "the request head did not arrive within the read timeout"),
}

#: Methods whose handler answers and keeps the connection: a body there would be read as the next request.
KEEPS_CONNECTION = frozenset({"GET", "HEAD"})
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a field name (RFC 9110 section 5.1)
_DIGITS = re.compile(rb"[0-9]+")


class Head(NamedTuple):
    """What :func:`read_head` read: an outcome (OK, CLOSED, ...), the head when OK, bytes that came after it."""

    outcome: int
    head: bytes
    rest: bytes
    partial: bool  # some bytes of a head came (a timeout then gets a 408)


def read_head(sock: socket.socket, pending: bytes, timeout: float) -> Head:
    """Read one request head (up to and with its blank line) from ``sock`` within ``timeout`` seconds in all."""
    buf = bytearray(pending)
    deadline = time.monotonic() + timeout
    while True:
        ends = [(at, len(mark)) for mark in (b"\r\n\r\n", b"\n\n") if (at := buf.find(mark)) >= 0]
        end, sep = min(ends) if ends else (-1, 0)  # the first blank line (CRLF, or bare LF as http.server takes)
        line_end = buf.find(b"\n")
        if (line_end < 0 and len(buf) > MAX_REQUEST_LINE) or line_end > MAX_REQUEST_LINE:
            return Head(LINE_TOO_LONG, b"", b"", True)
        if end >= 0:
            head = bytes(buf[: end + sep])
            if head.count(b"\n") - 2 > MAX_HEADERS:
                return Head(TOO_MANY_HEADERS, b"", b"", True)
            if len(head) > MAX_HEAD_BYTES:
                return Head(HEAD_TOO_LARGE, b"", b"", True)
            return Head(OK, head, bytes(buf[end + sep :]), True)
        if len(buf) > MAX_HEAD_BYTES:
            return Head(HEAD_TOO_LARGE, b"", b"", True)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return Head(TIMEOUT, b"", b"", bool(buf.strip()))
        try:
            sock.settimeout(remaining)
            chunk = sock.recv(min(65536, MAX_HEAD_BYTES + 1 - len(buf)))
        except TimeoutError:
            return Head(TIMEOUT, b"", b"", bool(buf.strip()))
        except OSError:
            return Head(CLOSED, b"", b"", bool(buf))
        if not chunk:
            return Head(CLOSED, b"", b"", bool(buf))
        buf += chunk


def _shown(raw: bytes) -> str:
    """A header's bytes for an error message: short, and every control character escaped."""
    text = raw[:60].decode("latin-1")
    return repr(text + ("..." if len(raw) > 60 else ""))


def framing_problem(fields: bytes, method: str) -> str | None:
    """Why the header lines ``fields`` (the head after its request line) of a ``method`` request are refused; None: fine."""
    lengths: list[bytes] = []
    for raw in fields.split(b"\n"):
        line = raw.removesuffix(b"\r")
        if not line:
            continue  # the blank line that ends the head
        if line[:1] in (b" ", b"\t"):
            return f"a folded header line (obs-fold) is refused: {_shown(line)}"
        if b"\0" in line or b"\r" in line:
            return f"a header line with a NUL or a bare CR is refused: {_shown(line)}"
        name, colon, value = line.partition(b":")
        if not colon:
            return f"a header line without a colon is refused: {_shown(line)}"
        if not _TOKEN.fullmatch(name):
            why = "whitespace before its colon" if name.rstrip(b" \t") != name else "a name that is no token"
            return f"a header line with {why} is refused: {_shown(line)}"
        lowered = name.lower()
        value = value.strip(b" \t")
        if lowered == b"transfer-encoding":
            return f"Transfer-Encoding ({_shown(value)}) is refused: this endpoint reads no request body"
        if lowered == b"content-length":
            lengths.append(value)
    if not lengths:
        return None
    if len(lengths) > 1:
        given = ", ".join(_shown(v) for v in lengths)
        return f"Content-Length given {len(lengths)} times ({given}) is refused: a request has one length"
    length = lengths[0]
    if not _DIGITS.fullmatch(length):
        return f"Content-Length {_shown(length)} is refused: it is not one number of bytes"
    if method in KEEPS_CONNECTION and length.lstrip(b"0"):
        return (
            f"a {method} request with a body (Content-Length: {_shown(length)[1:-1]}) is refused: "
            "this endpoint reads no request body"
        )
    return None
