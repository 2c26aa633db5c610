"""The HTTP server around the app: uvicorn with h11 and a deadline on request headers.

uvicorn bounds idle keep-alive connections but not a client that trickles its request
line and headers, which would hold a socket (and a slot) for as long as it likes. The
header deadline runs from the connection's start and again after each response; the
body's deadline is the RequestGuard middleware's.

The protocol also records when each open connection was accepted
(`connection_born`, by client address): RequestGuard ends a kept-alive connection
older than the limits' max_connection_age_s with `connection: close`, so clients
reconnect through the Service and reach replicas added since they connected.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from slimspec.server.errors import ApiError, error_body

TIMEOUT_BODY = json.dumps(
    error_body(ApiError(408, "request_timeout", "request headers did not arrive in time"))
).encode()


# (host, port) of an open connection -> time.monotonic() when it was accepted
connection_born: dict[tuple[str, int], float] = {}


def connection_age(client: Any) -> float | None:
    """Seconds since the connection of an ASGI scope's `client` was accepted (None:
    not a connection this server's protocol recorded)."""
    born = connection_born.get(tuple(client)) if client else None
    return None if born is None else time.monotonic() - born


class HeaderDeadlineH11(H11Protocol):
    """h11 protocol that answers 408 and closes when a request's headers are not complete
    within header_timeout_s."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.client is not None:
            connection_born[self.client] = time.monotonic()
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        if self.client is not None:
            connection_born.pop(self.client, None)
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._unset_keepalive_if_required()
        head = (
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(TIMEOUT_BODY)
        )
        self.transport.write(head + TIMEOUT_BODY)
        self.transport.close()


def protocol_class(header_timeout_s: float) -> type[H11Protocol]:
    return type("SlimSpecH11", (HeaderDeadlineH11,), {"header_timeout_s": header_timeout_s})


def uvicorn_config(app: Any, header_timeout_s: float, **kw: Any) -> Any:
    """The uvicorn.Config `slimspec serve` runs (and the tests use)."""
    import uvicorn

    return uvicorn.Config(app, http=protocol_class(header_timeout_s), **kw)
