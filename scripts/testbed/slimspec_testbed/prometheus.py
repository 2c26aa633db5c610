"""A real Prometheus server on loopback (the ``prometheus`` binary of the test bed).

``PrometheusServer(binary, workdir, config).start()`` runs it on a free loopback port
and returns once it is ready: ``.url``, ``.port``, ``.stop()``, ``.start()`` (restart
on the same port and data dir, e.g. to test "metrics unavailable"), ``.query(promql)``
-> ``list`` of result dicts (``data.result``), ``.wait_for_query(promql, predicate,
timeout)``, ``.targets()`` (active targets), ``.log()``. ``scrape_config(targets)``
builds a config that scrapes ``host:port`` targets.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from slimspec_testbed.errors import fail
from slimspec_testbed.tools import free_port, stop_process

# What the tests' ``prometheus_server`` fixture yields: start(targets, *, scrape_interval,
# rule_files, extra_config, job) -> a ready PrometheusServer, stopped at test end.
PrometheusFactory = Callable[..., "PrometheusServer"]


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
        fail(f"Prometheus did not become ready on {self.url}:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 10) -> None:
        if self.proc is None:
            return
        stop_process(self.proc, timeout)
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
        fail(f"query {promql!r} did not satisfy predicate in {timeout}s: {result}")


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


def scrape_job(target: str, namespace: str, service: str) -> dict[str, Any]:
    """The target labels a ServiceMonitor adds, which the default queries select on."""
    return {
        "job_name": "slimspec",
        "static_configs": [
            {"targets": [target], "labels": {"namespace": namespace, "service": service}}
        ],
    }


def metric_value(text: str, name: str) -> float | None:
    """The first sample of metric `name` (any labels) in Prometheus' text format."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            rest = line[line.index("}") + 1 :]
        elif line.startswith(name + " "):
            rest = line[len(name) :]
        else:
            continue
        return float(rest.split()[0])
    return None
