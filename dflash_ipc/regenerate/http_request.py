"""One HTTP request to a server we do not trust: a total deadline, no redirects, a capped body.

The openai backend talks to a server the user names, which may be slow, broken or hostile.
urllib gives none of the three bounds it needs, so this module uses http.client directly:

- Deadline: `deadline_s` bounds the whole request (connect, send, status line, headers and
  body). A socket timeout bounds each recv only, so a server that trickles one byte a second
  would never trip it; a timer shuts the socket down when the deadline passes, which ends
  any blocking read at once, wherever it is.
- Redirects are never followed: a 3xx comes back as such (with its Location) and the caller
  refuses it, so the bearer token reaches only the origin the user named.
- Body: at most `max_bytes`. A declared Content-Length over it is refused before a byte of
  the body is read; a chunked or undeclared body is read in chunks and refused the moment
  it passes the bound. Memory per request is bounded whatever the server sends.

No proxy is used (HTTP_PROXY is ignored): the client connects to the URL's host itself.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass

_CHUNK = 1 << 16


class RequestFailed(Exception):
    """The request got no usable answer (connection, deadline, size, protocol): worth a retry
    for transient causes; the message says which."""


class AnswerTooLarge(RequestFailed):
    """The answer is over the byte bound: not retried (the same server will send it again)."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    location: str | None  # a redirect's Location header, never followed


def request(method: str, url: str, *, headers: dict, data: bytes | None, deadline_s: float,
            max_bytes: int) -> Answer:
    """Send one request; the answer within deadline_s and max_bytes, else RequestFailed."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RequestFailed(f"{url!r}: not an http(s) URL")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=deadline_s,
                                           context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=deadline_s)
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # every blocked read on it returns at once
            except OSError:
                pass

    timer = threading.Timer(deadline_s, cut)
    timer.daemon = True
    timer.start()
    try:
        # Connected first: a deadline that passed during the name lookup or the connect found no
        # socket to cut, so it is checked here, before a trickling server can hold the request.
        conn.connect()
        if expired.is_set():
            raise TimeoutError("connected after the deadline")
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        body = _read_capped(response, max_bytes)
        if response.length:  # http.client ends a short body at EOF without a word
            raise http.client.IncompleteRead(body, response.length)
    except AnswerTooLarge:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        if expired.is_set():
            raise RequestFailed(f"no complete answer within {deadline_s:g} s (--timeout-s)") from None
        raise RequestFailed(f"{type(e).__name__}: {e}"[:300]) from None
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():  # the cut came between two reads: what was read is not the whole answer
        raise RequestFailed(f"no complete answer within {deadline_s:g} s (--timeout-s)")
    return Answer(response.status, body, response.getheader("Location"))


def _read_capped(response: http.client.HTTPResponse, max_bytes: int) -> bytes:
    declared = response.getheader("Content-Length")
    if declared is not None and declared.strip().isdigit() and int(declared) > max_bytes:
        raise AnswerTooLarge(f"an answer of {int(declared)} bytes (Content-Length), over the bound of "
                             f"{max_bytes} bytes; refused unread")
    chunks, total = [], 0
    while True:
        chunk = response.read(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise AnswerTooLarge(f"an answer over the bound of {max_bytes} bytes; refused after reading "
                                 f"{total} bytes")
        chunks.append(chunk)
