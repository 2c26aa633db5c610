"""Test bed tools: binary lookup, helm, promtool and a real Prometheus server.

Binaries come from ``scripts/testbed/install.sh`` (cached under ``$SLIMSPEC_CACHE``,
default ``~/.cache/slimspec``); pinned versions live in ``scripts/testbed/versions.sh``.
A missing binary makes the fixture *fail* (never skip) with the command to run.

Fixtures
--------
``helm`` (function scope, needs ``kube_cluster``): a :class:`Helm`;
    ``helm.path`` is the binary, ``helm("install", "rel", chart_dir, "-n", ns)``
    runs it with the cluster's kubeconfig and returns ``CompletedProcess`` (text;
    raises ``subprocess.CalledProcessError`` with stderr in the message on failure
    unless ``check=False``).
``helm_local`` (function scope, no cluster): the same for ``lint``/``template``.
``promtool`` (session): ``Path`` to promtool.
``prometheus_server`` (function): factory ``start(targets, *, scrape_interval="1s",
    rule_files=(), extra_config=None) -> PrometheusServer``. The server runs on a
    free loopback port, is ready when returned, and is stopped at test end.
    ``PrometheusServer``: ``.url``, ``.port``, ``.stop()``, ``.start()`` (restart on
    the same port and data dir, e.g. to test "metrics unavailable"), ``.query(promql)``
    -> ``list`` of result dicts (``data.result``), ``.wait_for_query(promql,
    predicate, timeout)``, ``.targets()`` (active targets), ``.log()``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSIONS_FILE = REPO_ROOT / "scripts" / "testbed" / "versions.sh"
INSTALL_HINT = "run `bash scripts/testbed/install.sh` first (or `make test`)"


def cache_dir() -> Path:
    """The same cache root as scripts/lib.sh computes."""
    if os.environ.get("SLIMSPEC_CACHE"):
        return Path(os.environ["SLIMSPEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "slimspec"


def pinned_versions() -> dict[str, str]:
    """KEY=VALUE pairs of scripts/testbed/versions.sh."""
    out: dict[str, str] = {}
    for line in VERSIONS_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key] = value.strip().strip("\"'")
    return out


def venv_bin() -> Path:
    return Path(os.environ.get("SLIMSPEC_VENV", REPO_ROOT / ".venv")) / "bin"


def tool_path(name: str) -> Path:
    """Absolute path of a test bed binary, or ``pytest.fail`` saying how to get it."""
    if name in ("kube-apiserver", "kube-controller-manager"):
        path = cache_dir() / "k8s" / pinned_versions()["K8S_VERSION"] / name
    elif name in ("etcd", "etcdctl"):
        path = venv_bin() / name
    else:
        path = cache_dir() / "bin" / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"test bed binary {name!r} not found at {path}: {INSTALL_HINT}", pytrace=False)
    return path


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_checked(
    argv: Sequence[str | os.PathLike[str]],
    *,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 120,
    input: str | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """subprocess.run with text output; a failure message that includes stderr."""
    proc = subprocess.run(
        [str(a) for a in argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        cwd=cwd,
    )
    if check and proc.returncode != 0:
        cmd = " ".join(str(a) for a in argv)
        raise subprocess.CalledProcessError(
            proc.returncode, cmd, proc.stdout, f"{proc.stderr}\n(command: {cmd})"
        )
    return proc


# --------------------------------------------------------------------------- helm


@dataclass
class Helm:
    """helm bound to one kubeconfig; call it like a function."""

    path: Path
    env: dict[str, str]

    def __call__(
        self, *args: str | os.PathLike[str], check: bool = True, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        return run_checked([self.path, *args], env=self.env, check=check, timeout=timeout)


def _helm_env(base: dict[str, str], home: Path) -> dict[str, str]:
    """Own cache/config/data dirs so tests never touch ~/.config/helm."""
    env = dict(base)
    for var, sub in (
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ):
        env[var] = str(home / sub)
    return env


@pytest.fixture
def helm(kube_cluster: Any, tmp_path: Path) -> Helm:
    """helm v3 talking to the test cluster (its kubeconfig in the environment)."""
    return Helm(path=tool_path("helm"), env=_helm_env(kube_cluster.env, tmp_path / "helm"))


@pytest.fixture
def helm_local(tmp_path: Path) -> Helm:
    """helm v3 without a cluster, for lint/template/package (starts nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return Helm(path=tool_path("helm"), env=_helm_env(env, tmp_path / "helm"))


# ------------------------------------------------------------------ prometheus


@pytest.fixture(scope="session")
def promtool() -> Path:
    return tool_path("promtool")


def _http_get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


@dataclass
class PrometheusServer:
    """A real Prometheus process on loopback; stop()/start() keep port and data."""

    binary: Path
    workdir: Path
    config: dict[str, Any]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.workdir / "prometheus.yml"

    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self, timeout: float = 30) -> PrometheusServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.config_file.write_text(yaml.safe_dump(self.config))
        argv = [
            str(self.binary),
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ]
        with (self.workdir / "prometheus.log").open("ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                break
            try:
                _http_get(f"{self.url}/-/ready", timeout=1)
                return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        pytest.fail(f"Prometheus did not become ready on {self.url}:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 10) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        body = json.loads(_http_get(f"{self.url}/api/v1/{path}?{query}"))
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus API error: {body}")
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=promql)["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])

    def wait_for_query(
        self,
        promql: str,
        predicate: Callable[[list[dict[str, Any]]], bool] = bool,
        timeout: float = 30,
    ) -> list[dict[str, Any]]:
        """Poll a query until predicate(result) holds; fail with the last result."""
        deadline = time.monotonic() + timeout
        result: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.25)
        pytest.fail(f"query {promql!r} did not satisfy predicate in {timeout}s: {result}")


def scrape_config(
    targets: Sequence[str],
    scrape_interval: str = "1s",
    job: str = "slimspec",
    rule_files: Sequence[str | os.PathLike[str]] = (),
    metrics_path: str = "/metrics",
) -> dict[str, Any]:
    """A Prometheus config scraping host:port targets."""
    return {
        "global": {
            "scrape_interval": scrape_interval,
            "evaluation_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
        },
        "rule_files": [str(r) for r in rule_files],
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": metrics_path,
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }


PrometheusFactory = Callable[..., PrometheusServer]


@pytest.fixture
def prometheus_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusFactory]:
    """Factory: start(targets, scrape_interval="1s", rule_files=(), extra_config=None)."""
    binary = tool_path("prometheus")
    servers: list[PrometheusServer] = []

    def start(
        targets: Sequence[str],
        *,
        scrape_interval: str = "1s",
        rule_files: Sequence[str | os.PathLike[str]] = (),
        extra_config: dict[str, Any] | None = None,
        job: str = "slimspec",
    ) -> PrometheusServer:
        config = scrape_config(targets, scrape_interval, job, rule_files)
        config.update(extra_config or {})
        server = PrometheusServer(binary, tmp_path_factory.mktemp("prometheus"), config)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()
