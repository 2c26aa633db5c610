"""The engine pod's preStop hook, run for real against a local HTTP server that
records what the engine's POST /admin/drain would receive."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from slimspec_operator.resource.spec import SlimSpecService
from slimspec_operator.rollout import manifests as m

from .helpers import body


def test_prestop_drains_with_token_and_bounded_timeout(tmp_path: Path):
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length", 0))
            seen.append(
                {
                    "path": self.path,
                    "auth": self.headers.get("Authorization"),
                    "body": json.loads(self.rfile.read(n)),
                }
            )
            out = b'{"status":"drained"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    dep = m.deployment(SlimSpecService.from_body(body()), 1)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    cmd = c["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "python"
    env_names = {e["name"] for e in c["env"]}
    assert {"SLIMSPEC_ADMIN_TOKEN_FILE", "PORT"} <= env_names  # what the hook reads
    env = {
        "SLIMSPEC_ADMIN_TOKEN_FILE": str(token),
        "PORT": str(server.server_port),
        "SLIMSPEC_PRESTOP_SLEEP": "0",
    }
    try:
        out = subprocess.run(
            [sys.executable, *cmd[1:]], env=env, capture_output=True, text=True, timeout=20
        )
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stderr
    assert "drained" in out.stdout
    assert seen == [
        {
            "path": "/admin/drain",
            "auth": "Bearer s3cret",
            "body": {"timeout_s": m.DRAIN_TIMEOUT_SECONDS, "delay_s": 0.0},
        }
    ]
    # the propagation delay, then a drain as long as the longest request, fit the grace
    # period with room for the HTTP timeout
    assert m.DRAIN_TIMEOUT_SECONDS >= m.ENGINE_REQUEST_TIMEOUT_SECONDS
    assert m.PRESTOP_SLEEP_SECONDS + m.DRAIN_TIMEOUT_SECONDS + 5 < m.TERMINATION_GRACE_SECONDS
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == (
        m.TERMINATION_GRACE_SECONDS
    )
    mount = {v["mountPath"] for v in c["volumeMounts"]}
    assert m.ADMIN_TOKEN_DIR in mount


def test_prestop_never_fails_the_pod_when_the_engine_is_gone(tmp_path: Path):
    dep = m.deployment(SlimSpecService.from_body(body()), 1)
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]
    env = {
        "SLIMSPEC_ADMIN_TOKEN_FILE": str(tmp_path / "missing"),
        "PORT": "1",
        "SLIMSPEC_PRESTOP_SLEEP": "0",
    }
    out = subprocess.run(
        [sys.executable, *cmd["command"][1:]], env=env, capture_output=True, text=True, timeout=20
    )
    assert out.returncode == 0 and "drain failed" in out.stdout


def test_prestop_asks_the_engine_to_keep_serving_through_the_propagation_delay(tmp_path: Path):
    """The delay goes to the engine (it keeps answering while readiness is 503); without
    an engine the hook waits the delay itself, so the order holds either way."""
    import time

    dep = m.deployment(SlimSpecService.from_body(body()), 1)
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]
    assert "'delay_s':d" in cmd["command"][-1]
    assert f"'{m.PRESTOP_SLEEP_SECONDS}'" in cmd["command"][-1]  # the default delay
    env = {
        "SLIMSPEC_ADMIN_TOKEN_FILE": str(tmp_path / "missing"),
        "PORT": "1",
        "SLIMSPEC_PRESTOP_SLEEP": "0.6",
    }
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, *cmd["command"][1:]], env=env, capture_output=True, text=True, timeout=20
    )
    assert out.returncode == 0 and time.monotonic() - t0 >= 0.6
