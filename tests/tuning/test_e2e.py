"""End to end on loopback, real parts only: the API server, the tuning controller
as a kopf process, a real engine (`slimspec serve`, SmolLM2-135M) watching its
runtime ConfigMap, a real Prometheus scraping it, and real HTTP load.

The latency target is set far below what a CPU engine can do, so the p99 is over
it whatever the machine's speed; later far above it. The ratio must move up,
reach the engine (its /metrics), hold while Prometheus is down (MetricsAvailable
False), resume when it is back, and come down when latency is well under target.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from slimspec_testbed.prometheus import PrometheusFactory, scrape_job
from slimspec_testbed.resources import GROUP, PLURAL, VERSION, service_manifest
from slimspec_testbed.tools import free_port
from slimspec_testbed.tuning_scenario import (
    LoadGen,
    Recorder,
    engine_process,
    service_spec,
    tuner_process,
    wait_ready,
)

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.slow]

SVC = "chat"


def prom_value(url: str) -> Any:
    def query(promql: str) -> float | None:
        data = urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(f"{url}/api/v1/query?{data}", timeout=3) as resp:
                result = json.loads(resp.read())["data"]["result"]
        except OSError:
            return None
        return float(result[0]["value"][1]) if result else None

    return query


@pytest.fixture
def engine(
    kube_cluster: Any, namespace: str, small_real_model: Path, tmp_path: Path
) -> Iterator[str]:
    # The ConfigMap exists before the engine, as the reconciler would make it.
    core = client.CoreV1Api(kube_cluster.api_client())
    cm = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=f"{SVC}-runtime"),
        data={"compression_ratio": "0.3", "quality_threshold": "0.5", "fallback_strategy": "none"},
    )
    core.create_namespaced_config_map(namespace, cm)
    port = free_port()
    proc = engine_process(
        port, namespace, SVC, str(kube_cluster.kubeconfig), tmp_path, str(small_real_model)
    ).start()
    try:
        wait_ready(f"http://127.0.0.1:{port}/readyz", proc, timeout=240)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def test_latency_drives_the_ratio_through_the_engine(
    kube_cluster: Any,
    namespace: str,
    slimspec_crd: str,
    engine: str,
    prometheus_server: PrometheusFactory,
    tmp_path: Path,
) -> None:
    target = engine.removeprefix("http://")
    prom = prometheus_server(
        [target], extra_config={"scrape_configs": [scrape_job(target, namespace, SVC)]}
    )
    api = kube_cluster.api_client()
    custom = client.CustomObjectsApi(api)
    spec = service_spec(prom.url)
    custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, service_manifest(SVC, namespace, **spec)
    )
    q = spec["tuning"]["queries"]
    sel = {"{namespace}": namespace, "{service}": SVC}
    p99_q, rate_q = q["p99Latency"], q["requestRate"]
    for k, v in sel.items():
        p99_q, rate_q = p99_q.replace(k, v), rate_q.replace(k, v)
    rec = Recorder(api, namespace, SVC, engine, prom_value(prom.url), p99_q, rate_q)
    load = LoadGen(engine, workers=2).start()
    tuner = tuner_process(namespace, kube_cluster.env, tmp_path).start()
    try:
        rec.mark("p99 over target")
        # Two raises, each in force in the engine within seconds.
        up = rec.wait(lambda p: (p.status_ratio or 0) >= 0.4, 120, "ratio raised to 0.4")
        assert up.configmap_ratio == pytest.approx(up.status_ratio)
        rec.wait(lambda p: p.engine_ratio == pytest.approx(0.4), 20, "engine at 0.4")
        assert up.metrics_available == "True"

        rec.mark("Prometheus stopped")
        prom.stop()
        down = rec.wait(lambda p: p.metrics_available == "False", 30, "MetricsAvailable=False")
        held = down.status_ratio
        body = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, SVC)
        cond = next(c for c in body["status"]["conditions"] if c["type"] == "MetricsAvailable")
        assert cond["reason"] == "PrometheusUnreachable"
        for _ in range(3):  # several decision intervals: nothing moves
            time.sleep(3)
            p = rec.snapshot()
            assert p.status_ratio == held and p.metrics_available == "False"

        rec.mark("Prometheus back")
        prom.start()
        rec.wait(lambda p: p.metrics_available == "True", 60, "MetricsAvailable=True again")
        rec.wait(lambda p: (p.status_ratio or 0) > held, 90, "ratio moving again")

        rec.mark("p99 far under target")
        patch = {"spec": {"tuning": {"latencyTargetSeconds": 100}}}
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, SVC, patch)
        high = rec.snapshot().status_ratio
        low = rec.wait(lambda p: (p.status_ratio or 1) < high, 120, "ratio lowered")
        rec.wait(lambda p: p.engine_ratio == pytest.approx(low.status_ratio), 20, "engine lower")
        assert load.errors == 0
        assert not any(
            p.status_ratio is not None and not 0.1 <= p.status_ratio <= 0.5 for p in rec.points
        )
    finally:
        load.stop()
        tuner.stop()
        print(tuner.log(3000))
