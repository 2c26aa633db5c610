"""Dashboard, alerts and the example scrape config against the real thing.

A real engine (`python -m slimspec serve`, a tiny random Llama pair saved to
disk, CPU, float32) answers a few requests. Its /metrics must expose every
engine metric the dashboard and the alerts query. Then a real Prometheus
scrapes it with the relabelling of examples/prometheus/prometheus.yml and
loads examples/prometheus/slimspec-rules.yaml, and every dashboard query and
the tuner's default queries run on it.

Service discovery: the test bed's Prometheus is Debian's build, which has no
Kubernetes service discovery compiled in, so `kubernetes_sd_configs` is
replaced by a file_sd file holding the `__meta_kubernetes_pod_*` labels that
Kubernetes pod discovery gives an engine pod; the pod is a real object on the
test bed's API server (made like the operator makes them, its IP set to the
loopback where the engine listens). The relabel rules themselves run unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families
from slimspec_testbed.cluster.handle import KubeCluster
from slimspec_testbed.tools import free_port

from .conftest import REPO, contract_metrics, dashboard_exprs
from .test_monitoring import METRIC, engine_histograms, metric_names

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus]

EXAMPLES = REPO / "examples" / "prometheus"
GPU_ONLY = {"slimspec_gpu_utilization_ratio", "slimspec_gpu_memory_used_bytes"}


def char_tokenizer() -> Any:
    """A character-level tokenizer over the tiny models' 96 ids."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)][:93]
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
    )


def save_tiny_pair(root: Path) -> tuple[Path, Path]:
    from tests.support.tiny_models import noisy_copy, tiny_model

    target = tiny_model("llama", seed=0)
    draft = noisy_copy(target, noise=0.3, seed=1)
    tok = char_tokenizer()
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        out = root / name
        model.save_pretrained(out)
        tok.save_pretrained(out)
        dirs.append(out)
    return dirs[0], dirs[1]


def http(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real engine server on a tiny model pair; yields its base URL."""
    root = tmp_path_factory.mktemp("engine")
    target, draft = save_tiny_pair(root)
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    log = (root / "engine.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slimspec",
            "serve",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model-version",
            "v1",
            "--max-new-tokens",
            "64",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(OSError):
                if http("GET", f"{base}/readyz")[0] == 200:
                    break
            assert proc.poll() is None, (root / "engine.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "engine not ready in 180 s"
            time.sleep(0.5)
        for i in range(6):
            code, text = http("POST", f"{base}/infer", {"input": f"def f{i}(x):", "max_length": 12})
            assert code == 200, text
        assert http("POST", f"{base}/infer", {"input": "", "max_length": -1})[0] in (400, 422)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def scraped_families(base: str) -> set[str]:
    code, text = http("GET", f"{base}/metrics")
    assert code == 200
    names = set()
    for fam in text_string_to_metric_families(text):
        names.add(fam.name)
        if fam.type == "counter":
            names.add(fam.name + "_total")
        if fam.type == "info":
            names.add(fam.name + "_info")
    return names


def test_every_queried_engine_metric_is_exported(engine: str) -> None:
    rules = yaml.safe_load((EXAMPLES / "slimspec-rules.yaml").read_text())
    exprs = [e for _, e in dashboard_exprs()]
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    queried = set()
    for e in exprs:
        for m in metric_names(e):
            for suffix in ("_bucket", "_sum", "_count"):
                if m.endswith(suffix) and m[: -len(suffix)] in engine_histograms():
                    m = m[: -len(suffix)]
            queried.add(m)
    engine_metrics = {m for m in queried if not m.startswith("slimspec_operator_")}
    exported = scraped_families(engine)
    missing = engine_metrics - exported - GPU_ONLY
    assert not missing, f"queried but not exported by the engine: {sorted(missing)}"
    # The GPU metrics are documented as GPU-only (docs/contracts.md).
    assert contract_metrics() >= GPU_ONLY
    assert METRIC.pattern  # same extractor as the offline test


def _meta_labels(pod: client.V1Pod) -> list[dict[str, Any]]:
    """What Prometheus' Kubernetes pod discovery yields for each container port."""

    def sane(name: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", name)

    groups = []
    for c in pod.spec.containers:
        for p in c.ports or []:
            labels = {
                "__meta_kubernetes_namespace": pod.metadata.namespace,
                "__meta_kubernetes_pod_name": pod.metadata.name,
                "__meta_kubernetes_pod_ip": pod.status.pod_ip,
                "__meta_kubernetes_pod_phase": pod.status.phase,
                "__meta_kubernetes_pod_ready": "true",
                "__meta_kubernetes_pod_container_name": c.name,
                "__meta_kubernetes_pod_container_port_name": p.name or "",
                "__meta_kubernetes_pod_container_port_number": str(p.container_port),
                "__meta_kubernetes_pod_container_port_protocol": p.protocol or "TCP",
            }
            for k, v in (pod.metadata.labels or {}).items():
                labels[f"__meta_kubernetes_pod_label_{sane(k)}"] = v
                labels[f"__meta_kubernetes_pod_labelpresent_{sane(k)}"] = "true"
            groups.append(
                {"targets": [f"{pod.status.pod_ip}:{p.container_port}"], "labels": labels}
            )
    return groups


def test_example_scrape_config_dashboard_and_tuner_queries_on_real_prometheus(
    engine: str,
    kube_cluster: KubeCluster,
    namespace: str,
    pod_driver: Any,
    prometheus_server: Any,
    tmp_path: Path,
) -> None:
    port = int(engine.rsplit(":", 1)[1])
    labels = {
        "app.kubernetes.io/name": "slimspec-engine",
        "app.kubernetes.io/instance": "chat",
        "app.kubernetes.io/managed-by": "slimspec-operator",
        "slimspec.io/model-version": "v1",
    }
    pod_body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "chat-engine-0", "namespace": namespace, "labels": labels},
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "image": "ghcr.io/slimspec/engine:0.1.0",
                    "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
                }
            ]
        },
    }
    with kube_cluster.api_client() as api:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(namespace, pod_body)
        # The engine listens on loopback: that is this pod's IP here.
        core.patch_namespaced_pod_status(
            "chat-engine-0",
            namespace,
            {"status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}},
        )
        pod_driver.mark(namespace, "app.kubernetes.io/instance=chat")
        pod = core.read_namespaced_pod("chat-engine-0", namespace)
    assert pod.status.pod_ip == "127.0.0.1" and pod.status.phase == "Running"

    sd_file = tmp_path / "pods.json"
    sd_file.write_text(json.dumps(_meta_labels(pod)))
    example = yaml.safe_load((EXAMPLES / "prometheus.yml").read_text())
    scrape_configs = []
    for sc in example["scrape_configs"]:
        sc = dict(sc)
        assert sc.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        sc["file_sd_configs"] = [{"files": [str(sd_file)], "refresh_interval": "1s"}]
        sc["scrape_interval"] = "1s"
        sc["scrape_timeout"] = "1s"
        scrape_configs.append(sc)
    prom = prometheus_server(
        [],
        rule_files=[EXAMPLES / "slimspec-rules.yaml"],
        extra_config={"scrape_configs": scrape_configs},
    )
    sel = f'namespace="{namespace}",service="chat"'
    up = prom.wait_for_query(f"up{{{sel}}}", lambda r: r and r[0]["value"][1] == "1", 60)
    assert up[0]["metric"]["job"] == "slimspec-engines"
    assert up[0]["metric"]["pod"] == "chat-engine-0"
    assert up[0]["metric"]["model_version"] == "v1"
    # A few scrapes with traffic in between, so rates have two points.
    for i in range(4):
        http("POST", f"{engine}/infer", {"input": f"x = {i}", "max_length": 8})
        time.sleep(1.2)
    prom.wait_for_query(
        f"sum(rate(slimspec_requests_total{{{sel}}}[10s]))",
        lambda r: bool(r) and float(r[0]["value"][1]) > 0,
        30,
    )

    # Every dashboard query runs; the core panels have data.
    results = {}
    for title, expr in dashboard_exprs():
        q = (
            expr.replace("$__rate_interval", "15s")
            .replace("$namespace", namespace)
            .replace("$service", "chat")
        )
        results.setdefault(title, []).append(prom.query(q))
    for title in (
        "Requests per second (QPS)",
        "Request latency p95 / p99",
        "Compression ratio in force",
        "Mean accepted length (tokens per verify step)",
        "Queue depth",
        "Generated tokens per second",
    ):
        assert all(results[title]), f"no data for panel {title!r}"

    # The operator's tuner finds the engine with its default queries.
    from slimspec_operator.resource.queries import DEFAULT_QUERIES
    from slimspec_operator.tuning.prometheus.queries import render_query

    for key in ("p99Latency", "requestRate", "meanAcceptedLength", "fallbackRate"):
        q = render_query(DEFAULT_QUERIES[key], namespace, "chat", "15s")
        assert prom.query(q), f"tuner query {key} finds no data: {q}"

    # The example's rules loaded and evaluate without errors.
    groups = prom.api("rules")["groups"]
    assert {g["name"] for g in groups} == {"slimspec.recording", "slimspec.rules"}
    for g in groups:
        for r in g["rules"]:
            assert r["health"] == "ok", r
