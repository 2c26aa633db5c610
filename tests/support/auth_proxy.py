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
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from tests.support.loopback import LoopbackServer


@dataclass
class AuthProxy(LoopbackServer):
    upstream: str
    bearer: str | None = None
    basic: tuple[str, str] | None = None
    tls: tuple[Path, Path] | None = None  # (certificate, key)
    fail_with: tuple[int, bytes] | None = None
    requests: list[str] = field(default_factory=list)

    def tls_files(self) -> tuple[Path, Path] | None:
        return self.tls

    def expected(self) -> str:
        if self.bearer is not None:
            return f"Bearer {self.bearer}"
        assert self.basic is not None
        return "Basic " + base64.b64encode(":".join(self.basic).encode()).decode()

    def handle(self, req: BaseHTTPRequestHandler) -> None:
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
