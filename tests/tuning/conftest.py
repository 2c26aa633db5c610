"""Shared pieces of the tuning tests: a real metrics exporter with a load knob
that can act as a small simulated engine (its p99 a function of the ratio in its
runtime ConfigMap, its predictions per ratio as the metric contract says), the
SlimSpecService CRD on the real API server, and a Prometheus that scrapes with
the labels a ServiceMonitor would add."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from slimspec_operator.contract import RATIO_KEY, format_ratio
from slimspec_operator.tuning.reasons import Reason
from slimspec_testbed.prometheus import PrometheusFactory, PrometheusServer, scrape_job
from slimspec_testbed.tools import free_port

from .plant import GRID, Kind, Plant

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "slimspecservice.yaml"
KEDA_CRD_FILE = REPO / "tests" / "fixtures" / "keda" / "scaledobjects.keda.sh.yaml"


# The engine's reason labels (slimspec_compression_can_help_info).
ENGINE_REASON = {
    Reason.HEAD_SHARE_TOO_SMALL: "head_share_small",
    Reason.ACCEPTANCE_LOSS: "acceptance_loss",
}

# Fine buckets: histogram_quantile interpolates inside a bucket, so coarse ones
# would hide a ratio's effect on p99.
BUCKETS = (*(round(0.02 * i, 2) for i in range(1, 76)), 2.0, 5.0, 10.0)


@dataclass
class LoadExporter:
    """A real prometheus_client exporter with the engine's metric names, fed by a
    thread that records `rate` requests/s of `latency` seconds each.

    With a `plant`, it is a small simulated engine: the latency is the plant's
    p99 at the ratio in force (`follow` reads it from the runtime ConfigMap the
    tuner writes) and `load`, and with `claims` it exports the per-ratio
    predictions an engine of that kind would (a kind other than the plant's is
    a wrong prediction).
    """

    target: str
    rate: float = 0.0
    latency: float = 0.1
    kept: float = 0.99
    plant: Plant | None = None
    load: float = 1.0
    ratio: float = 0.3
    claims: Kind | None = None
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _stop: threading.Event = field(default_factory=threading.Event)
    _predictions: list[Any] = field(default_factory=list)

    def set(self, rate: float | None = None, latency: float | None = None, kept=None) -> None:
        if rate is not None:
            self.rate = rate
        if latency is not None:
            self.latency = latency
        if kept is not None:
            self.kept = kept

    def simulate(self, plant: Plant, claims: Kind | None = None, load: float = 1.0) -> None:
        """Latency from `plant` at the ratio in force; predictions as `claims` says."""
        self.plant, self.claims, self.load = plant, claims, load

    def current_latency(self) -> float:
        return self.plant.p99(self.ratio, self.load) if self.plant else self.latency

    def follow(self, core: client.CoreV1Api, namespace: str, configmap: str) -> None:
        """Apply the ratio of the runtime ConfigMap, as an engine watching it does."""

        def poll() -> None:
            while not self._stop.wait(0.2):
                try:
                    cm = core.read_namespaced_config_map(configmap, namespace)
                    self.ratio = float((cm.data or {})[RATIO_KEY])
                except (client.ApiException, KeyError, ValueError, OSError):
                    continue

        threading.Thread(target=poll, daemon=True).start()

    def _export_predictions(self) -> None:
        """The engines' per-ratio predictions, from the plant of the kind claimed."""
        if self.claims is None or self.plant is None:
            for metric in self._predictions:
                self.registry.unregister(metric)
            self._predictions.clear()
            return
        r = self.registry
        if not self._predictions:
            self._predictions = [
                Gauge("slimspec_ratio_predicted_speedup", "s", ["ratio"], registry=r),
                Gauge("slimspec_ratio_kept_acceptance", "k", ["ratio"], registry=r),
                Gauge("slimspec_draft_head_share", "h", ["ratio"], registry=r),
                Gauge("slimspec_ratio_best", "b", registry=r),
                Gauge("slimspec_compression_can_help", "c", registry=r),
                Gauge("slimspec_compression_can_help_info", "i", ["reason"], registry=r),
                Gauge("slimspec_head_ranking_age_seconds", "a", registry=r),
                Gauge("slimspec_head_ranking_coverage", "v", registry=r),
            ]
        speedup, kept, share, best, can_help, why, age, coverage = self._predictions
        pred = self.plant.predictions(self.claims)
        for ratio in GRID:
            label = format_ratio(ratio)
            speedup.labels(label).set(pred.speedup[ratio])
            kept.labels(label).set(pred.kept[ratio])
            share.labels(label).set(pred.head_share[ratio])
        best.set(pred.best or 0.0)
        can_help.set(1.0 if pred.can_help else 0.0)
        reason = "helps" if pred.can_help else ENGINE_REASON.get(pred.reason or "", "")
        for r in ("helps", "head_share_small", "acceptance_loss", "not_measured"):
            why.labels(r).set(1.0 if r == reason else 0.0)
        age.set(42.0)
        coverage.set(0.93)

    def run(self) -> None:
        r = self.registry
        hist = Histogram(
            "slimspec_request_latency_seconds",
            "latency",
            ["endpoint"],
            buckets=BUCKETS,
            registry=r,
        )
        reqs = Counter("slimspec_requests", "requests", ["endpoint", "code"], registry=r)
        kept = Gauge("slimspec_acceptance_kept_ratio", "kept", registry=r)
        ratio = Gauge("slimspec_compression_ratio", "ratio", registry=r)
        Gauge("slimspec_mean_accepted_length", "mal", registry=r).set(2.0)
        Gauge("slimspec_queue_depth", "queue", registry=r)
        owed = 0.0
        while not self._stop.wait(0.1):
            kept.set(self.kept)
            ratio.set(self.ratio)
            self._export_predictions()
            owed += self.rate * 0.1
            while owed >= 1.0:
                owed -= 1.0
                reqs.labels("/infer", "200").inc()
                hist.labels("/infer").observe(self.current_latency())


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
