"""A reverse proxy on loopback that puts authentication (and optionally TLS) in front
of a real Prometheus, as an ingress or kube-rbac-proxy would in a real cluster.

``AuthProxy(upstream, bearer="t")`` or ``AuthProxy(upstream, basic=("u", "p"))``;
``tls=(cert, key)`` serves https. A request without the right ``Authorization``
header gets 401; others are forwarded to ``upstream`` and answered with its status
and body. ``fail_with=(status, body)`` answers every authorised request with that
instead (a server that is not Prometheus). ``requests`` records the Authorization
header of each request.
"""

from __future__ import annotations

import base64
import ssl
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType


@dataclass
class AuthProxy:
    upstream: str
    bearer: str | None = None
    basic: tuple[str, str] | None = None
    tls: tuple[Path, Path] | None = None  # (certificate, key)
    fail_with: tuple[int, bytes] | None = None
    requests: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.server_address[1]
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"

    def expected(self) -> str:
        if self.bearer is not None:
            return f"Bearer {self.bearer}"
        assert self.basic is not None
        return "Basic " + base64.b64encode(":".join(self.basic).encode()).decode()

    def start(self) -> AuthProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy._forward(self)

            def do_POST(self) -> None:
                proxy._forward(self)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(self.tls[0]), str(self.tls[1]))
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> AuthProxy:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _forward(self, req: BaseHTTPRequestHandler) -> None:
        auth = req.headers.get("Authorization", "")
        self.requests.append(auth)
        length = int(req.headers.get("Content-Length") or 0)
        body = req.rfile.read(length) if length else None
        if auth != self.expected():
            return self._answer(req, 401, b"Unauthorized\n", "text/plain")
        if self.fail_with is not None:
            return self._answer(req, self.fail_with[0], self.fail_with[1], "text/plain")
        headers = {"Content-Type": req.headers.get("Content-Type", "")}
        upstream = urllib.request.Request(
            self.upstream + req.path, data=body, method=req.command, headers=headers
        )
        try:
            with urllib.request.urlopen(upstream, timeout=10) as resp:
                status, data, kind = resp.status, resp.read(), resp.headers["Content-Type"]
        except urllib.error.HTTPError as err:
            status, data, kind = err.code, err.read(), err.headers["Content-Type"]
        self._answer(req, status, data, kind or "application/json")

    @staticmethod
    def _answer(req: BaseHTTPRequestHandler, status: int, data: bytes, kind: str) -> None:
        req.send_response(status)
        req.send_header("Content-Type", kind)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
