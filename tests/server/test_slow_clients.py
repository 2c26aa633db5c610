"""Slow and vanishing clients over raw sockets: headers and bodies have read deadlines
(408), and a client that aborts mid-upload is a 499 in the metrics, not a 500."""

from __future__ import annotations

import json
import re
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from slimspec.server.service import Limits

FAST_TIMEOUTS = Limits(
    max_new_tokens=256,
    max_input_tokens=400,
    max_input_chars=4000,
    max_body_bytes=200_000,
    request_timeout_s=60,
    header_timeout_s=0.5,
    body_timeout_s=0.5,
)


@pytest.fixture(scope="module")
def slow_base(tiny):  # type: ignore[no-untyped-def]
    from tests.server.conftest import running_server, tiny_config

    with running_server(tiny_config(tiny, limits=FAST_TIMEOUTS)) as base:
        yield base


def connect(base: str) -> socket.socket:
    u = urlsplit(base)
    s = socket.create_connection((u.hostname, u.port), timeout=10)
    return s


def read_all(s: socket.socket, limit_s: float = 5.0) -> bytes:
    s.settimeout(limit_s)
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open; got {out[:200]!r}")
    return out


def test_trickled_headers_get_408_and_the_socket_closed(slow_base: str) -> None:
    s = connect(slow_base)
    t0 = time.monotonic()
    s.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
    reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 4
    s.close()


def test_idle_keep_alive_then_trickle_is_cut_too(slow_base: str) -> None:
    s = connect(slow_base)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    s.sendall(b"GET /he")  # second request on the same connection, never finished
    reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in reply
    s.close()


def test_slow_body_gets_408(slow_base: str) -> None:
    s = connect(slow_base)
    body = json.dumps({"input": "hello", "max_length": 2}).encode()
    s.sendall(
        b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body[:5]
    )
    reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"request_timeout" in reply
    s.close()
    assert (
        httpx.post(f"{slow_base}/infer", json={"input": "ok", "max_length": 2}).status_code == 200
    )


@pytest.mark.parametrize("path", ["/infer", "/v1/completions"])
def test_abort_mid_upload_is_499_not_500(slow_base: str, path: str) -> None:
    def codes() -> dict[str, float]:
        text = httpx.get(f"{slow_base}/metrics").text
        pat = r'^slimspec_requests_total\{code="(\d+)",endpoint="' + re.escape(path) + r'"\} (\S+)$'
        return {c: float(v) for c, v in re.findall(pat, text, re.M)}

    before = codes()
    s = connect(slow_base)
    s.sendall(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt": "ab' % path.encode()
    )
    time.sleep(0.1)
    s.close()  # gone before the body is complete
    after = {}
    for _ in range(50):
        after = codes()
        if after.get("499", 0) > before.get("499", 0):
            break
        time.sleep(0.05)
    assert after.get("499", 0) == before.get("499", 0) + 1, after
    assert after.get("500", 0) == before.get("500", 0)
    assert not any(c.startswith("5") and after[c] > before.get(c, 0) for c in after)
