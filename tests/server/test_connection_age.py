"""Kept-alive connections have a maximum age: behind a Service, a client's connection
stays on the pod it first reached, so a replica added later would get none of the
clients that are already connected. After max_connection_age_s the next answer says
`connection: close` and the server closes the socket; the client reconnects (through
the Service: to any replica). No request is cut: only a complete answer closes."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from slimspec.server.service import Limits

GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


def limits(max_age: float) -> Limits:
    return Limits(max_new_tokens=256, max_input_tokens=400, max_input_chars=4000,
                  max_body_bytes=200_000, request_timeout_s=60,
                  max_connection_age_s=max_age)  # fmt: skip


def ask(s: socket.socket) -> tuple[bytes, bool]:
    """GET /healthz on `s`: the response's head and whether the server closed the
    socket after it."""
    s.sendall(GET)
    s.settimeout(5)
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(
        line.split(b":", 1)[1] for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ))  # fmt: skip
    while len(body) < length:
        body += s.recv(65536)
    s.settimeout(0.5)
    try:
        closed = s.recv(1) == b""
    except TimeoutError:
        closed = False
    return head.lower(), closed


def connect(base: str) -> socket.socket:
    u = urlsplit(base)
    return socket.create_connection((u.hostname, u.port), timeout=10)


def test_a_connection_older_than_the_limit_is_closed_after_its_next_answer(
    make_server: Callable[..., Any],
) -> None:
    with make_server(limits=limits(1.0)) as base:
        s = connect(base)
        head, closed = ask(s)
        assert head.startswith(b"http/1.1 200") and b"connection: close" not in head
        assert not closed  # young: kept alive
        time.sleep(1.2)
        head, closed = ask(s)
        assert head.startswith(b"http/1.1 200")  # the request is answered in full,
        assert b"connection: close" in head and closed  # then the connection ends
        s.close()
        fresh = connect(base)  # the client's next connection is young again
        head, closed = ask(fresh)
        assert head.startswith(b"http/1.1 200") and not closed
        fresh.close()


def test_zero_keeps_connections_for_as_long_as_the_client_likes(
    make_server: Callable[..., Any],
) -> None:
    with make_server(limits=limits(0)) as base:
        s = connect(base)
        ask(s)
        time.sleep(0.3)
        head, closed = ask(s)
        assert b"connection: close" not in head and not closed
        s.close()
