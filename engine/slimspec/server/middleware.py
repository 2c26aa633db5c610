"""The pure-ASGI guard in front of every route: API key, body size and read deadline,
client disconnects, in-flight accounting for drains, and request metrics (streams
included, until their last byte)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from slimspec.server.errors import ApiError, error_response
from slimspec.server.http import connection_age
from slimspec.server.metrics import GENERATION_ENDPOINTS

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's code for a client that went away before the answer


def needs_api_key(path: str) -> bool:
    """The inference routes (and the model list) sit behind the optional API key;
    health, readiness, metrics and the admin routes (own token) do not."""
    return path == "/infer" or path.startswith("/v1/")


def check_api_key(configured: str | None, header: str | None) -> None:
    """Pure decision: nothing to check without a key; else the header must carry it
    (constant-time compare; the key is never logged or echoed)."""
    if not configured:
        return
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "invalid_api_key", "missing API key: send Authorization: Bearer <key>")
    if not hmac.compare_digest(token.strip().encode(), configured.encode()):
        raise ApiError(401, "invalid_api_key", "invalid API key")


@dataclass
class InFlight:
    """Generation requests between their first byte in and their last byte out."""

    count: int = 0


class RequestGuard:
    """Pure ASGI middleware; `state` is the app state (service, config, in_flight)."""

    def __init__(self, app: Any, state: Any) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        cfg = self.state.config
        limit = self.state.service.limits.max_body_bytes
        headers = dict(scope.get("headers") or [])
        try:
            if needs_api_key(path):
                auth = headers.get(b"authorization", b"").decode("latin-1")
                check_api_key(cfg.api_key, auth)
            clen = headers.get(b"content-length")
            if clen is not None and clen.isdigit() and int(clen) > limit:
                raise ApiError(413, "body_too_large", f"body exceeds {limit} bytes")
        except ApiError as exc:
            await self._answer(scope, receive, send, exc, path)
            return
        body_deadline = time.monotonic() + self.state.service.limits.body_timeout_s
        seen = 0
        # a request without a body (no length or 0, not chunked) has nothing left to read
        body_done = clen in (None, b"0") and b"transfer-encoding" not in headers
        client_gone = False

        async def guarded_receive() -> Any:
            nonlocal seen, body_done, client_gone
            if body_done:
                msg = await receive()
            else:
                left = body_deadline - time.monotonic()
                try:
                    msg = await asyncio.wait_for(receive(), max(left, 0.001))
                except TimeoutError:
                    raise ApiError(
                        408, "request_timeout", "the request body did not arrive in time"
                    ) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise ApiError(413, "body_too_large", f"body exceeds {limit} bytes")
                body_done = not msg.get("more_body", False)
            elif msg["type"] == "http.disconnect" and not body_done:
                client_gone = True
            return msg

        generation = path in GENERATION_ENDPOINTS
        t0 = time.perf_counter()
        status = 500

        def connection_too_old() -> bool:
            limit = self.state.service.limits.max_connection_age_s
            age = connection_age(scope.get("client"))
            return limit > 0 and age is not None and age > limit

        async def watched_send(msg: Any) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                # Close the connection after this answer when the body did not all
                # arrive (408, 413, 401: the rest would be read as the next request), or
                # while draining: a kept-alive connection bypasses the Service, so its
                # client must reconnect (to a pod still in the endpoints) before the
                # drain's delay ends and new requests here are refused; or when it is
                # older than max_connection_age_s (a replica added since gets its share).
                if not body_done or self.state.service.draining or connection_too_old():
                    headers = [h for h in msg.get("headers", []) if h[0].lower() != b"connection"]
                    msg = {**msg, "headers": [*headers, (b"connection", b"close")]}
            await send(msg)

        in_flight: InFlight = self.state.service.in_flight
        if generation:
            in_flight.count += 1
        try:
            await self.app(scope, guarded_receive, watched_send)
        except Exception:
            if not client_gone:
                raise
            log.info("client closed the connection while sending its request to %s", path)
        finally:
            if generation:
                in_flight.count -= 1
                if client_gone:  # nobody to answer: not a server error, not the client's bad input
                    status = CLIENT_CLOSED
                m = self.state.service.metrics
                m.requests.labels(endpoint=path, code=str(status)).inc()
                if status < 400:
                    m.latency.labels(endpoint=path).observe(time.perf_counter() - t0)

    async def _answer(self, scope: Any, receive: Any, send: Any, exc: ApiError, path: str) -> None:
        resp = error_response(Request(scope, receive), exc)
        await resp(scope, receive, send)
        if path in GENERATION_ENDPOINTS:
            self.state.service.metrics.requests.labels(endpoint=path, code=str(exc.status)).inc()
