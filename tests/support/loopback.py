"""An HTTP server on 127.0.0.1 (a free port) in a daemon thread, for the stand-ins the
tests put where a real remote service would be (an auth proxy, a model hub).

Subclasses answer every request in ``handle``; ``tls=(cert, key)`` serves https. Use
it as a context manager: ``with Server(...) as s: ... s.url``.
"""

from __future__ import annotations

import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Self


@dataclass
class LoopbackServer:
    _server: ThreadingHTTPServer | None = field(default=None, init=False, repr=False)

    def tls_files(self) -> tuple[Path, Path] | None:
        """(certificate, key) to serve https with; plain http by default."""
        return None

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        port = self._server.server_address[1]
        return f"{'https' if self.tls_files() else 'http'}://127.0.0.1:{port}"

    def start(self) -> Self:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.handle(self)

            do_HEAD = do_POST = do_GET

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if (tls := self.tls_files()) is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
