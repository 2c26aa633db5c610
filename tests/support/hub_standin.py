"""A stand-in for the Hugging Face hub on loopback, serving real model directories.

No hub is reachable from the test machines, so `slimspec fetch --hf` (huggingface_hub's
snapshot_download) is pointed at this server with HF_ENDPOINT. It answers the calls
snapshot_download makes, as the hub does:

- ``GET /api/models/{repo}/revision/{rev}``: ``{"id", "sha", "siblings"}``;
- ``GET /api/models/{repo}/tree/{rev}?recursive=...``: the files, with git blob ids
  and, for weights, LFS sha256 and size;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: the file, with ``X-Repo-Commit``,
  ``ETag`` (LFS sha256 or git blob id) and ``Content-Length``.

With ``token`` set every request must carry ``Authorization: Bearer <token>``
(a gated model): others get 401. ``requests`` records (method, path, authorization).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Self
from urllib.parse import unquote, urlsplit

from tests.support.loopback import LoopbackServer

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
COMMIT = "1f2e3d4c5b6a79887766554433221100ffeeddcc"


@dataclass
class _File:
    path: Path
    size: int
    blob_id: str  # git blob sha1
    sha256: str | None  # LFS files only


def _describe(path: Path, rel: str) -> _File:
    data = path.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    lfs = hashlib.sha256(data).hexdigest() if rel.endswith(LFS_SUFFIXES) else None
    return _File(path, len(data), blob, lfs)


@dataclass
class HubStandIn(LoopbackServer):
    repos: dict[str, Path]  # repo id -> model directory
    token: str | None = None
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    _files: dict[str, dict[str, _File]] = field(default_factory=dict)

    def start(self) -> Self:
        for repo, root in self.repos.items():
            self._files[repo] = {
                p.relative_to(root).as_posix(): _describe(p, p.relative_to(root).as_posix())
                for p in sorted(root.rglob("*"))
                if p.is_file() and not p.name.startswith(".")
            }
        return super().start()

    # ------------------------------------------------------------------ answers

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        body = req.command != "HEAD"
        path = unquote(urlsplit(req.path).path)
        auth = req.headers.get("Authorization", "")
        self.requests.append((req.command, path, auth))
        if self.token is not None and auth != f"Bearer {self.token}":
            return self._json(req, 401, {"error": "Invalid credentials in Authorization header"})
        if path.startswith("/api/models/"):
            return self._api(req, path.removeprefix("/api/models/"))
        for repo, files in self._files.items():
            prefix = f"/{repo}/resolve/"
            if path.startswith(prefix):
                _rev, _, rel = path.removeprefix(prefix).partition("/")
                if rel in files:
                    return self._file(req, files[rel], body)
        self._json(req, 404, {"error": "Entry not found"})

    def _api(self, req: BaseHTTPRequestHandler, rest: str) -> None:
        for repo, files in self._files.items():
            if rest.startswith(f"{repo}/revision/"):
                siblings = [{"rfilename": rel} for rel in files]
                return self._json(req, 200, {"id": repo, "sha": COMMIT, "siblings": siblings})
            if rest.startswith(f"{repo}/tree/"):
                tree = []
                for rel, f in files.items():
                    entry: dict[str, object] = {
                        "type": "file",
                        "path": rel,
                        "size": f.size,
                        "oid": f.blob_id,
                    }
                    if f.sha256 is not None:
                        entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
                    tree.append(entry)
                return self._json(req, 200, tree)
        self._json(req, 404, {"error": "Repository not found"})

    def _file(self, req: BaseHTTPRequestHandler, f: _File, body: bool) -> None:
        req.send_response(200)
        req.send_header("X-Repo-Commit", COMMIT)
        req.send_header("ETag", f'"{f.sha256 or f.blob_id}"')
        req.send_header("Content-Length", str(f.size))
        req.send_header("Content-Type", "application/octet-stream")
        req.end_headers()
        if body:
            with f.path.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    req.wfile.write(chunk)

    @staticmethod
    def _json(req: BaseHTTPRequestHandler, code: int, doc: object) -> None:
        data = json.dumps(doc).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        if code == 401:
            req.send_header("X-Error-Code", "GatedRepo")
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)
