"""The tuner's shared reads: evaluations keep to one wall-clock grid, a grouped
query gives each resource what its own query would have answered (pure), and
against a real Prometheus scraping real exporters one grouped query per metric
per tick serves every resource with the sample its own queries would give it."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from slimspec_operator.resource.queries import (
    COMPRESSION_CAN_HELP,
    FALLBACK_RATE,
    P99_LATENCY,
    PREDICTED_SPEEDUP,
    QUERIES,
)
from slimspec_operator.resource.spec import TuningView
from slimspec_operator.tuning.plan import due_on_grid, grid_slot
from slimspec_operator.tuning.prometheus.errors import PromError, PromReason
from slimspec_operator.tuning.prometheus.queries import (
    answer_of,
    grouped_query,
    queries_for,
    shareable,
    split_grouped,
)
from slimspec_operator.tuning.prometheus.shared import SharedReads
from slimspec_operator.tuning.tick import read_sample
from slimspec_operator.tuning.types import Sample
from slimspec_testbed.prometheus import PrometheusFactory, PrometheusServer
from slimspec_testbed.tools import free_port

T0 = datetime(2026, 1, 1, tzinfo=UTC)  # a whole minute: the start of a 60 s slot


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def view(**tuning: object) -> TuningView:
    return TuningView.from_spec({"tuning": {"enabled": True, **tuning}})


def test_evaluations_keep_to_one_grid_for_every_resource() -> None:
    v = view(intervalSeconds=60)
    assert grid_slot(60, at(59.9)) + 1 == grid_slot(60, at(60))
    # A new resource waits for the start of a slot (its first timer period)...
    assert due_on_grid(v, None, at(20), at(62), 5)
    assert not due_on_grid(v, None, at(20), at(70), 5)
    # ... but never longer than one interval.
    assert due_on_grid(v, None, at(20), at(80), 5)
    # Then once per slot, whenever in it the timer fires.
    assert not due_on_grid(v, at(62), at(20), at(119), 5)
    assert due_on_grid(v, at(62), at(20), at(121), 5)
    assert due_on_grid(v, at(80), at(20), at(120), 5)


# ------------------------------------------------------------------ grouped queries


def series(ns: str, svc: str, value: str, **labels: str) -> dict[str, object]:
    return {"metric": {"namespace": ns, "service": svc, **labels}, "value": [0, value]}


def vector(*items: dict[str, object]) -> dict[str, object]:
    return {"resultType": "vector", "result": list(items)}


def test_every_built_in_query_has_a_grouped_form_by_namespace_and_service() -> None:
    for query in QUERIES:
        text = grouped_query(query, "2m")
        assert "namespace, service" in text and 'service!=""' in text, query.name
        assert "{" + "namespace}" not in text and "{window}" not in text
        scoped = grouped_query(query, "2m", "ml")
        assert 'namespace="ml",service!=""' in scoped


def test_only_resources_on_the_built_in_template_share_it() -> None:
    assert shareable(view(), P99_LATENCY)
    own = view(queries={"p99Latency": "max(my_latency)"})
    assert not shareable(own, P99_LATENCY) and shareable(own, FALLBACK_RATE)


def test_a_grouped_answer_is_what_each_resource_would_have_read() -> None:
    mine = queries_for(view(), "ml", "chat", False)
    p99 = split_grouped(
        vector(series("ml", "chat", "0.25"), series("ml", "idle", "NaN")), P99_LATENCY, "q"
    )
    assert answer_of(P99_LATENCY, p99, "ml", "chat", mine["p99Latency"]) == 0.25
    nan = answer_of(P99_LATENCY, p99, "ml", "idle", "own")
    assert isinstance(nan, PromError) and nan.reason == PromReason.NOT_A_NUMBER
    gone = answer_of(P99_LATENCY, p99, "other", "chat", mine["p99Latency"])
    assert isinstance(gone, PromError) and gone.reason == PromReason.NO_DATA
    assert mine["p99Latency"] in gone.message  # the resource's own query, as before
    # `or vector(0)`: no fallback series is no fallback.
    assert answer_of(FALLBACK_RATE, {}, "ml", "chat", "q") == 0.0

    speedups = vector(
        series("ml", "chat", "1.2", ratio="0.3"),
        series("ml", "chat", "1.5", ratio="0.5"),
        series("ml", "idle", "NaN", ratio="0.3"),
    )
    per_ratio = split_grouped(speedups, PREDICTED_SPEEDUP, "q")
    assert answer_of(PREDICTED_SPEEDUP, per_ratio, "ml", "chat", "q") == {"0.3": 1.2, "0.5": 1.5}
    empty = answer_of(PREDICTED_SPEEDUP, per_ratio, "ml", "idle", "q")
    assert isinstance(empty, PromError) and empty.reason == PromReason.NO_DATA

    down = PromError(PromReason.UNREACHABLE, "refused")
    assert answer_of(COMPRESSION_CAN_HELP, down, "ml", "chat", "q") is down
    with pytest.raises(PromError):
        split_grouped({"resultType": "matrix", "result": []}, P99_LATENCY, "q")


# ------------------------------------------------------------------ a real Prometheus

# (namespace, service) -> what its engine exports; "quiet" exports no series at all.
ENGINES = {("ml", "chat"): 0.2, ("ml", "code"): 0.6, ("web", "chat"): 1.1}
QUIET = ("web", "quiet")


def engine_registry(scale: float) -> tuple[CollectorRegistry, Callable[[], None]]:
    """The engine's metric names, values set from `scale`; and a request it serves."""
    reg = CollectorRegistry()
    latency = Histogram(
        "slimspec_request_latency_seconds", "l", buckets=(0.1, 0.5, 1, 2.5), registry=reg
    )
    requests = Counter("slimspec_requests", "r", registry=reg)
    for _ in range(int(20 * scale)):
        latency.observe(scale)
        requests.inc()
    Counter("slimspec_fallbacks", "f", registry=reg)
    Gauge("slimspec_mean_accepted_length", "m", registry=reg).set(2 + scale)
    Gauge("slimspec_acceptance_kept_ratio", "k", registry=reg).set(0.9 + scale / 100)
    Gauge("slimspec_queue_depth", "q", registry=reg).set(scale)
    speedup = Gauge("slimspec_ratio_predicted_speedup", "s", ["ratio"], registry=reg)
    kept = Gauge("slimspec_ratio_kept_acceptance", "a", ["ratio"], registry=reg)
    share = Gauge("slimspec_draft_head_share", "h", ["ratio"], registry=reg)
    for ratio in ("0", "0.3", "0.6"):
        speedup.labels(ratio).set(1 + scale * float(ratio))
        kept.labels(ratio).set(1 - scale * float(ratio) / 10)
        share.labels(ratio).set(0.2)
    Gauge("slimspec_ratio_best", "b", registry=reg).set(0.3)
    Gauge("slimspec_compression_can_help", "c", registry=reg).set(1 if scale < 1 else 0)
    info = Gauge("slimspec_compression_can_help_info", "i", ["reason"], registry=reg)
    info.labels("helps" if scale < 1 else "head_share_small").set(1)
    Gauge("slimspec_head_ranking_age_seconds", "g", registry=reg).set(100 * scale)
    Gauge("slimspec_head_ranking_coverage", "v", registry=reg).set(0.99)

    def serve() -> None:
        latency.observe(scale)
        requests.inc()

    return reg, serve


@pytest.fixture
def prometheus(prometheus_server: PrometheusFactory) -> Iterator[PrometheusServer]:
    servers, jobs, serving = [], [], []
    for (ns, svc), scale in ENGINES.items():
        port = free_port()
        reg, serve = engine_registry(scale)
        server, thread = start_http_server(port, "127.0.0.1", reg)
        servers.append((server, thread))
        serving.append(serve)
        jobs.append({"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": ns, "service": svc}})
    stop = threading.Event()

    def traffic() -> None:
        while not stop.wait(0.1):
            for serve in serving:
                serve()

    load = threading.Thread(target=traffic, daemon=True)
    load.start()
    config = {"scrape_configs": [{"job_name": "slimspec", "static_configs": jobs}]}
    prom = prometheus_server([], extra_config=config)
    prom.wait_for_query("count(up == 1)", lambda r: bool(r) and r[0]["value"][1] == "3", 30)
    # rate() needs two scrapes in its window
    prom.wait_for_query("count(slimspec_requests_total)", bool, 30)
    prom.wait_for_query(
        "min(count_over_time(slimspec_requests_total[20s]))",
        lambda r: bool(r) and float(r[0]["value"][1]) >= 3,
        30,
    )
    yield prom
    stop.set()
    load.join(5)
    for server, thread in servers:
        server.shutdown()
        thread.join(5)


def same(a: list[Sample], b: list[Sample]) -> bool:
    """Equal samples, but for rates, latencies and running totals read a moment apart
    (live traffic; a is read after b)."""
    live = ("p99_latency", "request_rate")
    totals = ("latency_sum", "generated_tokens")  # counters: only ever grow
    for x, y in zip(a, b, strict=True):
        for name in live:
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None) and (u is None or u == pytest.approx(v, rel=0.3))
        for name in totals:
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None) == (v is None) and (u is None or u >= v)
        blank = dict.fromkeys(live + totals)
        assert replace(x, **blank) == replace(y, **blank)
    return True


def query_count(prom: PrometheusServer) -> float:
    with urllib.request.urlopen(f"{prom.url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prometheus_http_requests_total{") and 'handler="/api/v1/query"' in line
    )


@pytest.mark.prometheus
def test_one_query_set_per_tick_gives_every_resource_its_own_sample(
    prometheus: PrometheusServer,
) -> None:
    view = TuningView.from_spec(
        {
            "prometheus": {"url": prometheus.url},
            "tuning": {"enabled": True, "intervalSeconds": 10},
            "autoscaling": {"enabled": True, "targetQueueDepth": 2},
        }
    )
    resources = [*ENGINES, QUIET]
    now = datetime.now(UTC)

    async def own() -> list[Sample]:
        return [await read_sample(view, ns, name, now) for ns, name in resources]

    async def shared(reads: SharedReads, at: datetime) -> list[Sample]:
        ticks = (read_sample(view, ns, name, at, shared=reads) for ns, name in resources)
        return list(await asyncio.gather(*ticks))

    before = query_count(prometheus)
    alone = asyncio.run(own())
    assert query_count(prometheus) - before == len(QUERIES) * len(resources)
    assert alone[0].p99_latency is not None and alone[0].predictions is not None
    assert alone[-1].missing and alone[-1].error is None  # the quiet one: NoData, as before

    async def ticks() -> None:
        reads = SharedReads(max_age_s=60)
        before = query_count(prometheus)
        together = await shared(reads, now)
        assert query_count(prometheus) - before == len(QUERIES)  # one set for all of them
        assert same(together, alone)
        assert await shared(reads, now) == together  # the same slot: no query
        assert query_count(prometheus) - before == len(QUERIES)
        await shared(reads, now + timedelta(seconds=10))  # the next slot reads again
        assert query_count(prometheus) - before == 2 * len(QUERIES)

    asyncio.run(ticks())
