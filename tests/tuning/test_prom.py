"""tuning/prometheus/client.py against a real Prometheus scraping a real exporter."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from slimspec_operator.resource.queries import DEFAULT_QUERIES
from slimspec_operator.resource.spec import TuningView
from slimspec_operator.tuning.prometheus.client import PromClient
from slimspec_operator.tuning.prometheus.errors import PromError, PromReason
from slimspec_operator.tuning.prometheus.queries import render_query
from slimspec_operator.tuning.tick import read_sample
from slimspec_testbed.prometheus import PrometheusFactory, PrometheusServer
from slimspec_testbed.tools import free_port

pytestmark = pytest.mark.prometheus


@dataclass
class Exporter:
    target: str
    latency: Histogram
    requests: Counter
    kept: Gauge


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    """The engine's metric names, served by a real prometheus_client exporter."""
    reg = CollectorRegistry()
    latency = Histogram(
        "slimspec_request_latency_seconds",
        "latency",
        ["endpoint"],
        buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        registry=reg,
    )
    requests = Counter("slimspec_requests", "requests", ["endpoint", "code"], registry=reg)
    kept = Gauge("slimspec_acceptance_kept_ratio", "kept", registry=reg)
    Gauge("slimspec_mean_accepted_length", "mal", registry=reg).set(2.5)
    Gauge("slimspec_queue_depth", "queue", registry=reg).set(1)
    Counter("slimspec_fallbacks", "fallbacks", ["reason"], registry=reg)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=reg)
    yield Exporter(f"127.0.0.1:{port}", latency, requests, kept)
    server.shutdown()
    thread.join(5)


def start_prom(factory: PrometheusFactory, target: str) -> PrometheusServer:
    # The labels a ServiceMonitor would attach, which the default queries select on.
    job = {
        "job_name": "slimspec",
        "static_configs": [{"targets": [target], "labels": {"namespace": "ns1", "service": "svc"}}],
    }
    return factory([target], extra_config={"scrape_configs": [job]})


def run(coro):  # small sync bridge keeps the tests linear
    return asyncio.run(coro)


def test_default_queries_read_the_engine_metrics(
    prometheus_server: PrometheusFactory, exporter: Exporter
) -> None:
    server = start_prom(prometheus_server, exporter.target)
    exporter.kept.set(0.97)
    for _ in range(50):
        exporter.latency.labels("/infer").observe(0.3)
        exporter.requests.labels("/infer", "200").inc()
    queries = {k: render_query(v, "ns1", "svc") for k, v in DEFAULT_QUERIES.items()}
    # rate() needs two scrapes inside the window, with new observations between them.
    server.wait_for_query(queries["keptAcceptance"], bool, timeout=20)
    exporter.latency.labels("/infer").observe(0.3)
    exporter.requests.labels("/infer", "200").inc()
    server.wait_for_query(queries["requestRate"], lambda r: bool(r) and float(r[0]["value"][1]) > 0)

    async def read() -> dict[str, float | PromError]:
        async with PromClient(server.url, timeout=5) as client:
            return await client.query_many(queries)

    got = run(read())
    assert 0.25 < got["p99Latency"] <= 0.5  # type: ignore[operator]
    assert got["requestRate"] > 0  # type: ignore[operator]
    assert got["keptAcceptance"] == pytest.approx(0.97)
    assert got["meanAcceptedLength"] == pytest.approx(2.5)
    assert got["queueDepth"] == pytest.approx(1)
    assert got["fallbackRate"] == 0.0

    # Another service's labels select nothing: NoData, not an exception.
    other = render_query(DEFAULT_QUERIES["requestRate"], "ns1", "other")
    err = run(_error(server.url, other))
    assert err.reason == PromReason.NO_DATA and not err.transport


async def _error(url: str, promql: str, timeout: float = 5) -> PromError:
    async with PromClient(url, timeout=timeout) as client:
        with pytest.raises(PromError) as info:
            await client.query_value(promql)
    return info.value


def test_error_kinds(prometheus_server: PrometheusFactory, exporter: Exporter) -> None:
    server = start_prom(prometheus_server, exporter.target)
    exporter.kept.set(math.nan)
    server.wait_for_query("slimspec_acceptance_kept_ratio", bool, timeout=20)

    nan = run(_error(server.url, "min(slimspec_acceptance_kept_ratio)"))
    assert nan.reason == PromReason.NOT_A_NUMBER
    bad = run(_error(server.url, "sum(rate(x[5m]"))
    assert bad.reason == PromReason.QUERY_ERROR and bad.transport
    many = run(_error(server.url, "up or vector(1)"))
    assert many.reason == PromReason.AMBIGUOUS
    # An exporter is an HTTP server, but not the query API.
    not_prom = run(_error(f"http://{exporter.target}", "up"))
    assert (
        not_prom.reason in (PromReason.BAD_RESPONSE, PromReason.HTTP_ERROR) and not_prom.transport
    )

    server.stop()
    down = run(_error(server.url, "up"))
    assert down.reason == PromReason.UNREACHABLE and down.transport
    server.start()
    server.wait_for_query("up", bool)

    async def scalar() -> float:
        async with PromClient(server.url) as client:
            return await client.query_value("scalar(vector(0.25))")

    assert run(scalar()) == 0.25


def test_timeout_on_a_server_that_never_answers() -> None:
    # A real listening socket that accepts and stays silent.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        err = run(_error(f"http://127.0.0.1:{port}", "up", timeout=0.5))
        assert err.reason == PromReason.TIMEOUT and err.transport
    finally:
        stop.set()
        thread.join(2)
        for c in conns:
            c.close()
        sock.close()


def test_predictions_are_read_per_ratio_and_averaged_over_pods(
    prometheus_server: PrometheusFactory,
) -> None:
    """Two engine pods of one service export per-ratio predictions; the tuner's
    read (tuning/tick.py read_sample, the real path) averages them by ratio, and
    only pods that have measured say whether compression can help."""
    servers, targets = [], []
    # The second pod has not measured yet: it exports 0 with the reason not_measured.
    pods = (({"0.0": 2.0, "0.3": 2.2}, 1, "helps"), ({"0.0": 2.0, "0.3": 2.6}, 0, "not_measured"))
    for speedups, can_help, reason in pods:
        reg = CollectorRegistry()
        g = Gauge("slimspec_ratio_predicted_speedup", "s", ["ratio"], registry=reg)
        for ratio, value in speedups.items():
            g.labels(ratio).set(value)
        Gauge("slimspec_compression_can_help", "c", registry=reg).set(can_help)
        info = Gauge("slimspec_compression_can_help_info", "i", ["reason"], registry=reg)
        for r in ("helps", "head_share_small", "acceptance_loss", "not_measured"):
            info.labels(r).set(1.0 if r == reason else 0.0)
        Gauge("slimspec_ratio_best", "b", registry=reg).set(0.3)
        Counter("slimspec_requests", "r", ["endpoint", "code"], registry=reg)
        port = free_port()
        servers.append(start_http_server(port, addr="127.0.0.1", registry=reg))
        targets.append(f"127.0.0.1:{port}")
    try:
        job = {
            "job_name": "slimspec",
            "static_configs": [
                {"targets": targets, "labels": {"namespace": "ns1", "service": "svc"}}
            ],
        }
        server = prometheus_server(targets, extra_config={"scrape_configs": [job]})
        query = render_query(DEFAULT_QUERIES["predictedSpeedup"], "ns1", "svc")
        server.wait_for_query(
            query, lambda r: len(r) == 2 and all(len(s["metric"]) == 1 for s in r)
        )
        server.wait_for_query(
            "count(slimspec_compression_can_help_info)",
            lambda r: bool(r) and r[0]["value"][1] == "8",
        )
        view = TuningView.from_spec(
            {"prometheus": {"url": server.url}, "tuning": {"enabled": True}}
        )
        sample = run(read_sample(view, "ns1", "svc", datetime.now(UTC)))
        pred = sample.predictions
        assert pred is not None
        assert pred.speedup == {0.0: pytest.approx(2.0), 0.3: pytest.approx(2.4)}
        assert pred.can_help is True  # the pod still measuring has no say
        assert pred.best == pytest.approx(0.3) and pred.kept == {}
    finally:
        for srv, thread in servers:
            srv.shutdown()
            thread.join(5)
