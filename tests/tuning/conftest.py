"""Shared pieces of the tuning tests: a real metrics exporter with a load knob,
the SlimSpecService CRD on the real API server, and a Prometheus that scrapes
with the labels a ServiceMonitor would add."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from slimspec_testbed.prometheus import PrometheusFactory, PrometheusServer, scrape_job
from slimspec_testbed.tools import free_port

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "slimspecservice.yaml"
KEDA_CRD_FILE = REPO / "tests" / "fixtures" / "keda" / "scaledobjects.keda.sh.yaml"


@dataclass
class LoadExporter:
    """A real prometheus_client exporter with the engine's metric names, fed by a
    thread that records `rate` requests/s of `latency` seconds each."""

    target: str
    rate: float = 0.0
    latency: float = 0.1
    kept: float = 0.99
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _stop: threading.Event = field(default_factory=threading.Event)

    def set(self, rate: float | None = None, latency: float | None = None, kept=None) -> None:
        if rate is not None:
            self.rate = rate
        if latency is not None:
            self.latency = latency
        if kept is not None:
            self.kept = kept

    def run(self) -> None:
        r = self.registry
        hist = Histogram(
            "slimspec_request_latency_seconds",
            "latency",
            ["endpoint"],
            buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10),
            registry=r,
        )
        reqs = Counter("slimspec_requests", "requests", ["endpoint", "code"], registry=r)
        kept = Gauge("slimspec_acceptance_kept_ratio", "kept", registry=r)
        Gauge("slimspec_mean_accepted_length", "mal", registry=r).set(2.0)
        Gauge("slimspec_queue_depth", "queue", registry=r)
        owed = 0.0
        while not self._stop.wait(0.1):
            kept.set(self.kept)
            owed += self.rate * 0.1
            while owed >= 1.0:
                owed -= 1.0
                reqs.labels("/infer", "200").inc()
                hist.labels("/infer").observe(self.latency)


@pytest.fixture
def load_exporter() -> Iterator[LoadExporter]:
    port = free_port()
    exp = LoadExporter(target=f"127.0.0.1:{port}")
    server, thread = start_http_server(port, addr="127.0.0.1", registry=exp.registry)
    feeder = threading.Thread(target=exp.run, daemon=True)
    feeder.start()
    yield exp
    exp._stop.set()
    feeder.join(5)
    server.shutdown()
    thread.join(5)


def start_prometheus(
    factory: PrometheusFactory, target: str, namespace: str, service: str
) -> PrometheusServer:
    return factory(
        [target], extra_config={"scrape_configs": [scrape_job(target, namespace, service)]}
    )


def wait_until(fn, timeout: float = 30, what: str = "condition", interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="session")
def slimspec_crd(kube_cluster: Any) -> str:
    """The operator's CRD, applied once per session (idempotent)."""
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    name = "slimspecservices.slimspec.io"
    kube_cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=30s")
    return name
